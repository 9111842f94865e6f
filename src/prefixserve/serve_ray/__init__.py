"""`prefixserve serve --replicas N`: N engine replicas behind one OpenAI-compatible endpoint,
as a Ray Serve application with Ray's prefix-affinity router. Nothing here that the
single-process server lacks: each replica runs server/'s app unchanged.

    options.py      the flags and ScaleOutConfig (no Ray import)
    launch.py       start or join Ray, run the application, take it down on SIGINT/SIGTERM
    ingress.py      the HTTP endpoint: auth, body limit, routing key, relay; /health, /metrics
    replica.py      EngineReplica: the engine + app of server/setup.py build_app
    bridge.py       an HTTP request carried over a Ray handle, run on the replica's ASGI app
    routing_key.py  what the router matches on: (partition, prompt)
    routers.py      Ray's router classes by name (the one place that imports them)
    board.py        replicas' health and metrics, for /health and /metrics
"""
