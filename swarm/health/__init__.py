"""The public swarm health page: `python -m swarm.health --initial-peers ...`.

survey.py reads the DHT, probe.py pings nodes, state.py runs both on a cadence and publishes
snapshots (snapshot.py), render.py turns one into HTML, app.py serves it with starlette.
"""
