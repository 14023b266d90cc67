"""What a trainer tells its launcher, as constants: the launcher imports these without loading
torch (checkpointer and preemption, which write them, do)."""

NOTICES = "checkpoints.jsonl"  # one JSON line per complete checkpoint or event, in the run folder
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: the run was stopped on purpose and a retry resumes it
PREEMPTED_EVENT = "preempted"
