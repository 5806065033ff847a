"""``autodist.close`` gives Paddle back every function apply_plan changed for the process.

Each module of ``PROCESS_PATCHES`` installs its change as apply_plan does; ``close`` must leave
every function in the namespaces a script reaches Paddle by as it was before (a module left out
of ``PROCESS_PATCHES``, or a restore that forgets one function, fails here).
"""

import paddle
import paddle.distributed
import paddle.distributed.fleet
import paddle.distributed.parallel
import paddle.framework
import paddle.framework.io

from autodist.applier import apply
from autodist.applier.checkpoint import plain_save
from autodist.applier.modes import exact_reductions, local_einsum, vector_concat, whole_metrics
from autodist.applier.placement import wrapped_again

NAMESPACES = {
    "paddle": paddle,
    "paddle._C_ops": paddle._C_ops,
    "paddle._legacy_C_ops": paddle._legacy_C_ops,
    "paddle.framework": paddle.framework,
    "paddle.framework.io": paddle.framework.io,
    "paddle.distributed.parallel": paddle.distributed.parallel,
    "paddle.distributed.fleet": paddle.distributed.fleet,
}


def functions() -> dict[tuple[str, str], object]:
    return {
        (home, name): value for home, ns in NAMESPACES.items() for name, value in vars(ns).items() if callable(value)
    }


def install_all() -> None:
    """As apply_plan installs them (apply.py), each module's own way in."""
    local_einsum.run_permutations_locally()
    exact_reductions.norm_exactly()
    exact_reductions.refuse_clip_grad_norm("a test")
    whole_metrics.measure_whole()
    vector_concat.concat_vectors_as_rows()
    plain_save.guard_saves("a test's own")
    wrapped_again.refuse_wrapping_again()


def test_close_gives_back_every_function():
    apply.close()  # Paddle's own, whatever a test before this one in the process left applied
    before = functions()
    install_all()
    changed = {key for key, value in functions().items() if before.get(key) is not value}
    homes = {key[0] for key in changed}
    # each module changed something a script reaches (so the check below checks something)
    assert {"paddle", "paddle._C_ops", "paddle._legacy_C_ops", "paddle.distributed.fleet"} <= homes, homes
    assert len(changed) >= 10, changed
    apply.close()
    after = functions()
    assert {key for key in changed if after[key] is not before[key]} == set()


def test_every_patching_module_is_closed():
    assert set(apply.PROCESS_PATCHES) == {
        local_einsum,
        exact_reductions,
        whole_metrics,
        vector_concat,
        plain_save,
        wrapped_again,
    }
