"""fastcoll.ops.checksum (torch.ops.fastcoll.checksum): the documented bitwise hash of each tensor's bytes.

Three implementations are checked against each other: a plain-Python
transcription of the definition in fastcoll.ops.checksum's docstring (Python
integers, byte by byte), the pure-PyTorch reference (fastcoll.ops.reference, the
oracle of the kernels) and the op itself (the C++ kernels when the extension is
built; on a CUDA machine, the CUDA kernel against the CPU one).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import examples

from fastcoll import ops
from fastcoll.bench.runner import num_threads
from fastcoll.ops import reference

CUDA = pytest.mark.cuda
HYP = dict(deadline=None, suppress_health_check=list(HealthCheck))

_M = (1 << 64) - 1
_K = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M
    return x ^ (x >> 31)


def py_hash(data: bytes) -> int:
    """The definition, transcribed with Python integers: the int64 value the op returns for these bytes."""
    s = 0
    for i in range(0, len(data), 8):
        w = int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little")
        s = (s + _mix(w ^ (((i // 8 + 1) * _K) & _M))) & _M
    h = _mix(s ^ _mix((len(data) + _K) & _M))
    return h - (1 << 64) if h >> 63 else h


def memory_bytes(t: torch.Tensor) -> bytes:
    """The numel * element_size bytes from data_ptr() (a dense tensor), in memory order."""
    return reference._bytes_of(t.detach().cpu()).numpy().tobytes()


def u8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


# Every dtype the op must hash (bytes are bytes): floating, integer, bool, complex.
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes of every value, reinterpreted as ``dtype`` (NaN payloads and all)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1  # only 0 and 1 are valid bools
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------
# The definition: reference and kernel against the plain-Python transcription
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", list(range(0, 41)) + [63, 64, 65, 1000, 4097])
def test_reference_and_op_match_the_definition(n):
    gen = torch.Generator().manual_seed(n)
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    expected = py_hash(memory_bytes(t))
    assert reference.checksum([t]).tolist() == [expected]
    assert ops.checksum([t]).tolist() == [expected]


def test_known_values():
    # Fixed values of the definition (computed by py_hash): a change to the hash shows up here.
    assert py_hash(b"") == ops.checksum([torch.empty(0, dtype=torch.uint8)]).item()
    values = ops.checksum([u8(b""), u8(b"\x00"), u8(b"fastcoll"), torch.arange(4, dtype=torch.int64)]).tolist()
    assert values == [py_hash(b""), py_hash(b"\x00"), py_hash(b"fastcoll"), py_hash(memory_bytes(torch.arange(4)))]
    assert len(set(values)) == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_matches_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    tensors = [random_tensor(shape, dtype, gen) for shape in [(1,), (3,), (5, 7), (2, 3, 5), (0,), (1031,), (33, 65)]]
    got = ops.checksum(tensors)
    assert got.dtype == torch.int64 and got.shape == (len(tensors),) and got.device.type == "cpu"
    assert torch.equal(got, reference.checksum(tensors))
    assert got.tolist() == [py_hash(memory_bytes(t)) for t in tensors]


@pytest.mark.parametrize("tail", range(1, 18))
@pytest.mark.parametrize("offset", range(0, 9))
def test_odd_lengths_and_misaligned_storage(tail, offset):
    """Byte lengths 1..17 (every partial last word) at every storage offset mod 8 (misaligned data_ptr)."""
    gen = torch.Generator().manual_seed(tail * 31 + offset)
    storage = torch.randint(0, 256, (offset + 64 + tail,), dtype=torch.uint8, generator=gen)
    tensors = [storage[offset : offset + tail], storage[offset : offset + 64 + tail], storage[offset:]]
    expected = [py_hash(memory_bytes(t)) for t in tensors]
    assert ops.checksum(tensors).tolist() == expected
    assert reference.checksum(tensors).tolist() == expected


@pytest.mark.parametrize("offset", range(0, 4))
def test_misaligned_wider_dtypes(offset):
    """float16 and float32 views at element offsets whose data_ptr is 2- or 4-byte aligned only."""
    gen = torch.Generator().manual_seed(offset)
    h = torch.randn(4099, generator=gen).half()[offset : offset + 4093]
    f = torch.randn(70001, generator=gen)[offset : offset + 69997]
    tensors = [h, f, h[1:].reshape(6, 682), f[:-3]]
    assert torch.equal(ops.checksum(tensors), reference.checksum(tensors))
    assert ops.checksum(tensors).tolist() == [py_hash(memory_bytes(t)) for t in tensors]


def test_memory_order_of_dense_non_contiguous_tensors():
    """A dense tensor is hashed in memory order: a channels_last tensor hashes its storage bytes."""
    x = torch.randn(2, 3, 4, 5)
    cl = x.contiguous(memory_format=torch.channels_last)
    t = torch.randn(6, 7).t()  # dense, transposed strides
    got = ops.checksum([cl, t]).tolist()
    assert got == [py_hash(memory_bytes(cl)), py_hash(memory_bytes(t))]
    assert got[0] == ops.checksum([x.permute(0, 2, 3, 1).contiguous()]).item()  # the same bytes, in that order
    assert got[1] == ops.checksum([t.t().contiguous()]).item()
    assert got == reference.checksum([cl, t]).tolist()


def test_many_tensors_and_large_ones_match_reference():
    gen = torch.Generator().manual_seed(3)
    tensors = [random_tensor((int(n),), torch.float32, gen) for n in torch.randint(0, 40, (300,), generator=gen)]
    tensors.insert(150, torch.randn(3 * 65536 + 5, generator=gen))
    tensors.append(torch.randn(1 << 20, generator=gen).to(torch.bfloat16))
    assert torch.equal(ops.checksum(tensors), reference.checksum(tensors))


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@settings(max_examples=examples(200), **HYP)
@given(data=st.binary(min_size=1, max_size=300), bit=st.integers(min_value=0), offset=st.integers(0, 7))
def test_any_single_flipped_bit_changes_the_hash(data, bit, offset):
    bit %= 8 * len(data)
    storage = u8(bytes(offset) + data)
    t = storage[offset:]
    before = ops.checksum([t]).item()
    t[bit // 8] ^= 1 << (bit % 8)
    after = ops.checksum([t]).item()
    assert before != after
    assert reference.checksum([t]).item() == after


@settings(max_examples=examples(50), **HYP)
@given(data=st.binary(min_size=16, max_size=200), i=st.integers(0), j=st.integers(0))
def test_swapping_two_different_words_changes_the_hash(data, i, j):
    """The word index is part of each term: the hash is of the bytes in order, not of the multiset of words."""
    n = len(data) // 8
    i, j = i % n, j % n
    words = [data[8 * k : 8 * k + 8] for k in range(n)]
    if words[i] == words[j]:
        return
    swapped = list(words)
    swapped[i], swapped[j] = words[j], words[i]
    assert py_hash(b"".join(words)) != py_hash(b"".join(swapped))
    assert ops.checksum([u8(b"".join(words))]).item() != ops.checksum([u8(b"".join(swapped))]).item()


@settings(max_examples=examples(30), **HYP)
@given(
    sizes=st.lists(st.integers(0, 100), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    perm_seed=st.integers(0, 2**31 - 1),
)
def test_permuted_tensors_give_permuted_values(sizes, seed, perm_seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    values = ops.checksum(tensors)
    perm = torch.randperm(len(tensors), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    assert ops.checksum([tensors[p] for p in perm]).tolist() == [values[p].item() for p in perm]


@pytest.mark.parametrize(
    "view_dtype", [torch.int32, torch.uint8, torch.int64, torch.float64, torch.int16, torch.complex64], ids=str
)
def test_equal_bytes_equal_values_across_dtypes(view_dtype):
    x = torch.randn(4, 8)
    v = x.view(view_dtype)
    assert ops.checksum([x]).item() == ops.checksum([v]).item() == py_hash(memory_bytes(x))
    assert ops.checksum([x, v]).unique().numel() == 1


def test_length_is_part_of_the_hash():
    """Trailing zero bytes are not padding: 3 and 5 zero bytes hash differently."""
    values = ops.checksum([torch.zeros(n, dtype=torch.uint8) for n in range(0, 17)]).tolist()
    assert len(set(values)) == 17


def test_deterministic_across_thread_counts():
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(1 << 21, generator=gen), torch.randn(5, generator=gen), torch.randn(300_001, generator=gen)[1:]]
    tensors += [torch.randint(0, 2**31, (n,), generator=gen) for n in (1, 70_000, 0, 9)]
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            results.append(ops.checksum(tensors).tolist())
    assert results[0] == results[1] == results[2] == reference.checksum(tensors).tolist()


def test_buffers_of_a_module():
    """Integer and bool buffers (num_batches_tracked) hash like any bytes."""
    bn = torch.nn.BatchNorm1d(3)
    bn.num_batches_tracked += 5
    tensors = [bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, torch.tensor([True, False])]
    got = ops.checksum(tensors)
    assert got.tolist() == [py_hash(memory_bytes(t)) for t in tensors]
    assert not got.requires_grad


# ---------------------------------------------------------------------------
# Arguments, errors, fake kernel
# ---------------------------------------------------------------------------


def test_empty_list_returns_empty_tensor():
    for got in (ops.checksum([]), torch.ops.fastcoll.checksum([]), reference.checksum([])):
        assert got.dtype == torch.int64 and got.shape == (0,)


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_errors_name_the_tensor(impl):
    fn = torch.ops.fastcoll.checksum if impl == "op" else reference.checksum
    ok = torch.randn(3)
    with pytest.raises(ValueError, match=r"fastcoll\.checksum: tensors\[1\] \(shape \(4, 2\), strides \(8, 4\)\) is not dense"):
        fn([ok, torch.randn(4, 8)[:, ::4]])
    with pytest.raises(TypeError, match=r"fastcoll\.checksum: tensors\[1\] has layout \S+; only strided"):
        fn([ok, torch.randn(3).to_sparse()])
    with pytest.raises(RuntimeError, match=r"fastcoll\.checksum: tensors\[1\] is on meta but tensors\[0\] is on cpu"):
        fn([ok, torch.empty(3, device="meta")])


def test_fake_kernel_and_opcheck():
    out = torch.ops.fastcoll.checksum([torch.empty(3, device="meta"), torch.empty(0, 2, device="meta")])
    assert out.device.type == "meta" and out.dtype == torch.int64 and out.shape == (2,)
    samples = [
        [torch.randn(3, 4), torch.arange(5), torch.tensor([True])],
        [torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.empty(0)],
    ]
    for tensors in samples:
        torch.library.opcheck(torch.ops.fastcoll.checksum.default, (tensors,))


def test_compiles_without_graph_break():
    def f(a, b):
        return ops.checksum([a, b]) + 1

    a, b = torch.randn(10), torch.arange(7)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(a, b), f(a, b))


# ---------------------------------------------------------------------------
# CUDA: the same bits as the CPU kernel
# ---------------------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(dtype):
    gen = torch.Generator().manual_seed(5)
    tensors = [random_tensor(shape, dtype, gen) for shape in [(1,), (3,), (5, 7), (0,), (1031,), (333, 65), (1 << 20,)]]
    cpu = ops.checksum(tensors)
    got = ops.checksum([t.cuda() for t in tensors])
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), cpu)
    assert torch.equal(reference.checksum([t.cuda() for t in tensors]).cpu(), cpu)


@CUDA
@pytest.mark.parametrize("offset", range(0, 9))
def test_cuda_odd_lengths_and_misaligned_storage(offset):
    gen = torch.Generator().manual_seed(offset)
    storage = torch.randint(0, 256, (offset + 300_000,), dtype=torch.uint8, generator=gen)
    cpu_tensors = [storage[offset : offset + n] for n in list(range(0, 18)) + [16384 * 8 + 3, 299_000]]
    gpu_storage = storage.cuda()
    gpu_tensors = [gpu_storage[offset : offset + t.numel()] for t in cpu_tensors]
    assert torch.equal(ops.checksum(gpu_tensors).cpu(), ops.checksum(cpu_tensors))
    h = torch.randn(100_001, generator=gen).half()
    assert torch.equal(ops.checksum([h.cuda()[offset:]]).cpu(), ops.checksum([h[offset:]]))


@CUDA
def test_cuda_many_tensors_uses_the_uploaded_table():
    gen = torch.Generator().manual_seed(9)
    tensors = [random_tensor((int(n),), torch.float32, gen) for n in torch.randint(0, 3000, (500,), generator=gen)]
    assert torch.equal(ops.checksum([t.cuda() for t in tensors]).cpu(), ops.checksum(tensors))


@CUDA
def test_cuda_flipped_bit_and_repeatability():
    x = torch.randn(5_000_001, device="cuda")
    first = ops.checksum([x, x[1:]])
    assert all(torch.equal(first, ops.checksum([x, x[1:]])) for _ in range(5))
    x.view(torch.uint8)[12345] ^= 4
    assert (ops.checksum([x, x[1:]]) != first).all()
    assert torch.equal(ops.checksum([x]).cpu(), ops.checksum([x.cpu()]))


@CUDA
def test_cuda_mixed_devices_rejected():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on cpu but tensors\[0\] is on cuda:0"):
        torch.ops.fastcoll.checksum([torch.randn(3, device="cuda"), torch.randn(3)])


def test_extension_serves_checksum():
    """A fresh build has the CPU kernel (and the CUDA one when built with CUDA), not the reference."""
    if ops.implementation() != "extension":
        pytest.skip("the compiled extension is not loaded")
    import fastcoll
    from fastcoll.ops import loader

    assert "checksum" not in loader.REFERENCE_OPS
    keys = ["CPU"] + (["CUDA"] if fastcoll.build_info()["cuda_kernels"] else [])
    for key in keys:
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastcoll::checksum", key), key
