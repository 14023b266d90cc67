"""The launcher–trainer contract as constants (docs/ARCHITECTURE.md, "The launcher–trainer
contract"): the launcher, preflight and Ray's driver import these without loading torch; the
trainer, checkpointer and preemption, which write the files, import them too."""

TRAIN_MODULE = "llmflow.tasks.pretrain.train"  # what every launcher starts, once per rank
CONFIG_FILE = "train_config.json"  # the trainer's config, written by the launcher before it starts
NOTICES = "checkpoints.jsonl"  # one JSON line per complete checkpoint or event, in the run folder
SUMMARY = "summary.json"  # the headline metrics, written by rank 0 once the stage is trained
RANKS = "ranks"  # ranks/rank-NNNNN.json: each rank's world size and first batch, after step 1
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: the run was stopped on purpose and a retry resumes it
PREEMPTED_EVENT = "preempted"
LAUNCHER_PID_ENV = "LLMFLOW_LAUNCHER_PID"  # a rank on the launcher's host dies with it
LAUNCHER_HOST_ENV = "LLMFLOW_LAUNCHER_HOST"  # where that PID means something (launcher_host)
