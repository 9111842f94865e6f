"""Ray Serve's request routers, by the name `--router` takes: the only place that imports one.

`prefix` is Ray's `PrefixCacheAffinityRouter`: it keeps a character prefix tree of the routing
keys it sent to each replica and sends a request to the replica whose keys share the longest
prefix with its own (while queue lengths stay balanced; below a 10% match, to the replica with
the least text). `pow2` is Ray Serve's default, power of two choices on queue length.

The public path `ray.serve.llm.request_router` imports `ray.serve.llm`, which needs
`ray[llm]` (pyarrow, and vLLM for the rest of it); the class it re-exports lives in
`ray.llm._internal...prefix_aware_router`, which needs only `ray[serve]`. We try the public
path first and fall back to the internal one, which is why `prefixserve[ray]` pins Ray.
"""

from __future__ import annotations

import importlib

from .options import ROUTERS

_PREFIX_ROUTER_PATHS = (
    "ray.serve.llm.request_router",
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router",
)


def prefix_router_class() -> type:
    """Ray's PrefixCacheAffinityRouter; ImportError saying what to install if this Ray lacks it."""
    problems = []
    for path in _PREFIX_ROUTER_PATHS:
        try:
            return importlib.import_module(path).PrefixCacheAffinityRouter
        except (ImportError, AttributeError) as e:
            problems.append(f"{path}: {e!r}")
    raise ImportError("--router prefix needs Ray Serve's PrefixCacheAffinityRouter, which the installed Ray "
                      "lacks; install the pinned version with `pip install 'prefixserve[ray]'` "
                      f"({'; '.join(problems)})")


def request_router_config(name: str):
    """The `RequestRouterConfig` for the engine deployment; None means Ray's default (pow2)."""
    if name not in ROUTERS:
        raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {name!r}")
    if name == "pow2":
        return None
    from ray.serve.config import RequestRouterConfig
    # Ray's pydantic-compat model: mypy sees its constructor's keywords untyped (dict[str, Any])
    return RequestRouterConfig(request_router_class=prefix_router_class())  # type: ignore[arg-type]
