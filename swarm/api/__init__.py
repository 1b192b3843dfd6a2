"""An OpenAI-compatible HTTP API and a chat page in front of the swarm (`python -m swarm.api`)."""
