"""``fastcoll.dist``: the distributed helpers' public import path (implemented in :mod:`fastcoll.distributed`).

``from fastcoll.dist import get_rank, reduce_mean, init_dist, ...`` as the
OpenMMLab and vis4d utilities are imported; see :mod:`fastcoll.distributed`
for what each does.
"""

from .distributed import *  # noqa: F403 (the public names, as fastcoll.distributed.__all__ lists them)
from .distributed import (  # noqa: F401 (reachable here as they were before the package moved)
    DEFAULT_PORT,
    LARGE_PAYLOAD_BYTES,
    LAUNCHERS,
    LOCAL_TMP_ROOT,
    LaunchInfo,
    __all__,  # noqa: F401
    expand_slurm_nodelist,
    resolve_launch,
    slurm_first_host,
)
