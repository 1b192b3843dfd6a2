"""Moving a session, KV cache and all, to another node serving the same blocks: a leaving
node's sessions to replicas, or a prefill node's to the node that decodes them.

One hand-over, top to bottom:

- send.py, on the node the session leaves: `hand_over_all` (a drain) or `hand_off` (after a
  prompt pass) -> `hand_over` -> `_send_cache` (`Handover`, the cache so far, what a prompt
  adds meanwhile, `_pause`, the tail, `HandoverEnd` signed with the node's key, `Taken`)
  -> `_pass_on` (`Moved` to the owner and sink, their `Release`, the held steps, `Release`).
- receive.py, on the node it goes to: `take` (admitted like an open, its cache coming) ->
  `take_chunk` / `take_tail` -> `end` (checked, installed, `Taken`) -> `resume` (its next
  owner and sink claim it) and `release` (the sender's last steps are in): its owner changes.
- follow.py, on the node before the one it leaves: `follow` (`Moved` -> `Resume` at the
  replica -> `Release` at the leaving node once its queued steps have gone).
- cache.py, sans IO: the cache cut into slabs, their digest, the receiver's `CacheIntake`
  checking every chunk, and `pick_replicas`.

The session's own part is where it stands (`Move` in swarm/node/session_state.py, one table) and the
steps it holds meanwhile. Each side takes the node's `SessionContext`, never the node.
"""
