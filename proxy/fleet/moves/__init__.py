"""Sessions that move between workers while they serve: the mover (`mover`), the
router's side of a move, its holds and its table (`move_table`), waiting for a session's
requests to end (`session_watch`) and running `/run` episodes handed over at their
boundary (`handovers`). It knows the workers only by their channels."""
