"""The public swarm health page: `python -m swarm.health --initial-peers ...`.

state.py reads the DHT (swarm.dht.read_swarm) and pings nodes (swarm.transport.ping) on a
cadence and publishes snapshots (snapshot.py), render.py turns one into HTML, app.py serves it
with starlette.
"""
