"""Classify a failure of PyTorch's optimizer tests under the fastcoll adapter: its kind and a one-line cause.

Kinds: ``"refused"`` (fastcoll, or the DDP contract, refuses the pattern
loudly: acceptable), ``"behaviour"`` (an assertion on a result failed: the
wrapped optimizer did something else than the torch optimizer; a bug), and
``"error"`` (any other error, or a hang: a bug unless :data:`KNOWN` explains it).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

#: (pattern searched in the failure's text, kind, cause). The first match wins.
KNOWN: List[Tuple[str, str, str]] = [
    (
        r"is not known to update parameters elementwise|cannot be sharded:",
        "refused",
        "ShardedOptimizer refuses a class whose update is not elementwise (LBFGS, SparseAdam, Adafactor, Muon)",
    ),
    (r"parameter '\w+' has dtype torch\.complex", "refused", "fastcoll.DDP refuses complex parameters"),
    (
        r"received no gradient in its backward",
        "refused",
        "a parameter of the optimizer gets no gradient in a synchronized backward (set by hand, or frozen mid-test): "
        "fastcoll.DDP raises at the next forward, as torch DDP (find_unused_parameters=False) does",
    ),
    (
        r"the module has no parameter that requires a gradient",
        "refused",
        "no parameter of the optimizer requires a gradient: fastcoll.DDP refuses such a module, as torch DDP does",
    ),
    (
        r"ShardedOptimizer: parameter '\w+' \(shape .*\) is not dense",
        "refused",
        "ShardedOptimizer refuses a non-dense parameter (the tests' contiguous=False views): each rank updates a range "
        "of every parameter's memory, which such a parameter does not have in one block (fastcoll.DDP accepts it, as "
        "torch DDP does)",
    ),
    (
        r"post accumulate grad hooks cannot be registered on non-leaf tensors",
        "refused",
        "non-leaf tensors as parameters (the tests' differentiable=True clones): DDP cannot hook them; torch's own "
        "RuntimeError, which does not name fastcoll",
    ),
    (
        r"grads='sharded'\): the gradient of this parameter is divided",
        "refused",
        "grads='sharded': the test reads p.grad, which refuses to be read (the gradient lives in ranges)",
    ),
]


#: Diagnosed causes of behaviour differences and errors (one line each, for the lead): test function -> cause.
DIAGNOSED: Dict[str, str] = {
    "test_state_dict_deterministic": "stale parameters after step(): at world size 2 each rank's own range is "
    "updated at step()'s return, the rest only at the next forward (overlap_param_gather=True)",
    "test_deepcopy_copies_all_public_attrs": "copy.deepcopy(ShardedOptimizer) loses inner/model/reducer/grads/...: "
    "torch.optim.Optimizer.__getstate__ keeps only defaults/state/param_groups and ShardedOptimizer does not "
    "override it (the copy is a broken optimizer, silently)",
    "test_state_dict_pre_hook": "ShardedOptimizer.state_dict() ignores hooks from register_state_dict_pre_hook "
    "(it overrides Optimizer.state_dict without running them), silently",
    "test_state_dict_post_hook": "ShardedOptimizer.state_dict() ignores register_state_dict_post_hook hooks, silently",
    "test_state_dict_pre_post_hook": "ShardedOptimizer.state_dict() ignores state_dict pre/post hooks, silently",
    "test_load_state_dict_pre_hook_and_prepend": "ShardedOptimizer.load_state_dict() ignores "
    "register_load_state_dict_pre_hook hooks (lr stays 0.01, the hook sets 0.002), silently",
    "test_load_state_dict_post_hook": "ShardedOptimizer.load_state_dict() ignores register_load_state_dict_post_hook "
    "hooks, silently",
    "test_load_state_dict_pre_post_hook": "ShardedOptimizer.load_state_dict() ignores load_state_dict pre/post hooks, silently",
    "test_no_cyclic_references": "a fastcoll object (ShardedOptimizer, DDP, reducer or a part) is in a reference cycle: "
    "freed only by the cyclic garbage collector (tests/test_no_cycles.py names the types; back-references go "
    "through fastcoll._backref)",
    "test_fused_error_on_params_on_meta|meta tensors": "ShardedOptimizer's constructor calls float(step) on a "
    "meta-device state tensor (_has_stepped): torch's error instead of a fastcoll message",
    "test_fused_error_on_params_on_meta|RuntimeError not raised": "grads='sharded': a p.grad set by hand (no "
    "backward) is ignored by step(), silently (checked by hand too: SGD lr=0.5, p=1, p.grad=1 gives p=1.0, torch "
    "0.5); the contract says refuse loudly",
    "test_rosenbrock_sparse|after a backward under no_sync": "grads='sharded', step(closure) whose closure runs "
    "zero_grad() (the adapter's forward) and backward, then sets a sparse p.grad by hand: fastcoll says the backward "
    "ran under no_sync(), which the test never used (misleading message; cause not diagnosed further)",
    "test_rosenbrock_sparse|dense and sparse": "a sparse p.grad set by hand (grads='full'): torch's copy_() error from "
    "fastcoll/optim/gradients.py (memory_order_grad), not a fastcoll message; at world size 2 it is raised only "
    "on the rank whose range needs it, the other rank stalls (see the crashed/StallError rows)",
    "test_rosenbrock_sparse|StallError|crashed|waited .* for collective": "after a sparse p.grad set by hand one "
    "rank raises in step() and the other waits in the parameters' all-gather: a StallError, or the ranks' next "
    "test cannot connect (crash); the error is not raised on every rank",
}


#: Diagnosed causes that are errors (the rest of :data:`DIAGNOSED` are behaviour differences).
_ERROR_CAUSE = re.compile(r"torch's error|torch's copy_|not raised on every rank|misleading message")


def last_error_line(detail: str) -> str:
    """The last ``SomethingError: ...`` line of a traceback (or its last line)."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (errors[-1] if errors else (lines[-1] if lines else ""))[:240]


def classify(result: Dict[str, Any], config: str, test: str = "") -> Tuple[str, str]:
    """``(kind, cause)`` of a failed test's result in ``config`` (``test``: its name, for :data:`DIAGNOSED`)."""
    kind, cause = _classify(result, config)
    head = re.sub(r"_cpu_\w+$", "", test)
    for key, why in DIAGNOSED.items():
        name, _, error = key.partition("|")
        if error and not re.search(error, result.get("detail", "")):
            continue
        if kind == "refused" and not error:
            continue  # a refusal stays one unless the diagnosis names its error (a StallError that is a symptom)
        if config != "plain" and re.match(rf"{name}(_|$)", head) and why not in cause:
            # Each diagnosed cause is a bug: a result that differs is "behaviour" (also where the test then trips
            # over a KeyError), the rest "error".
            return ("error" if _ERROR_CAUSE.search(why) else "behaviour"), f"{why} [{cause}]"
    return kind, cause


def _classify(result: Dict[str, Any], config: str) -> Tuple[str, str]:
    detail = result.get("detail", "")
    if detail.startswith(("timeout", "crashed")):
        return "error", detail.splitlines()[0]
    for pattern, kind, cause in KNOWN:
        if re.search(pattern, detail):
            return kind, cause
    line = last_error_line(detail)
    generic = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    if config == "plain":
        return "error", "fails with the plain torch optimizer too: " + generic
    if line.startswith("AssertionError"):
        where = _test_line(detail)
        if result.get("without_overlap") == "passed":
            where = "stale parameters after step() (passes with overlap_param_gather=False); " + where
        return "behaviour", f"{where}: {generic}"
    if "fastcoll" in line:
        return "refused", generic
    return "error", generic


def _test_line(detail: str) -> str:
    """The test's own statement that failed: ``function: code`` (from the traceback's last upstream frame)."""
    found = ""
    lines = detail.splitlines()
    for i, ln in enumerate(lines):
        m = re.search(r'File ".*/upstream/.*", line \d+, in (\w+)', ln)
        if m and i + 1 < len(lines):
            found = f"{m.group(1)}: `{lines[i + 1].strip()}`"
    return found


_OPTIMS = "Adadelta|Adafactor|Adagrad|AdamW|Adamax|Adam|ASGD|LBFGS|Muon|NAdam|RAdam|RMSprop|Rprop|SGD|SparseAdam"


def family(tests: List[str]) -> str:
    """``tests`` compressed: each test function once, with the optimizer classes it failed for."""
    by: Dict[str, List[str]] = {}
    for t in sorted(tests):
        m = re.fullmatch(rf"(.*)_({_OPTIMS})_cpu_\w+", t)
        head, opt = (m.group(1), m.group(2)) if m else (t, "")
        by.setdefault(head, [])
        if opt and opt not in by[head]:
            by[head].append(opt)
    return "; ".join(f"`{h}` [{', '.join(o)}]" if o else f"`{h}`" for h, o in by.items())
