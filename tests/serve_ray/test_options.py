"""`serve --replicas` flags: validated before Ray or a model starts (no Ray needed)."""

import pytest

from prefixserve.cli import build_parser
from prefixserve.serve_ray.options import ScaleOutConfig


def _config(*flags: str) -> ScaleOutConfig:
    return ScaleOutConfig.from_args(build_parser().parse_args(["serve", *flags]))


def test_defaults_and_gpus_follow_tensor_parallel():
    assert _config("--replicas", "2") == ScaleOutConfig(2, "prefix", None, 1.0, 0.0)
    assert _config("--replicas", "2", "--device", "cuda", "--tensor-parallel-size", "2").gpus_per_replica == 2


@pytest.mark.parametrize("flags,message", [
    (("--replicas", "0"), "--replicas must be a positive integer, got 0"),
    (("--replicas", "2", "--cpus-per-replica", "-1"), "--cpus-per-replica must be >= 0, got -1"),
    (("--replicas", "2", "--gpus-per-replica", "0.5"), "--gpus-per-replica 0.5 shares a GPU"),
])
def test_bad_flags_name_their_value(flags, message):
    with pytest.raises(ValueError, match=message):
        _config(*flags)


def test_the_single_process_server_does_not_import_ray():
    import subprocess
    import sys
    code = ("import sys; from prefixserve.cli import build_parser; build_parser().parse_args(['serve']); "
            "import prefixserve.server.cli, prefixserve.server.api; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
