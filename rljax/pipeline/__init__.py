"""The loops around the engine and the learner, bottom to top: a module imports only the
modules before it in `LAYERS` (tests/test_configs.py checks it).

  npz, metrics, layout     encodings, run metrics, the storage root's layout
  wire, work_queue         groups as arrays; the prompt-group work queue's records and keys
  queue_owner              the queue's trainer end
  queue_client             the queue's rollout-host end
  lineage                  which groups each async update trained on
  rollout, evaluate        episodes on the engine; held-out pass@k
  config_error             ConfigError, init_from's checkpoint directory
  recipe                   the sft / rl optimizer recipe: lr schedule, AdamW settings, checks
  env_setup                the config's tokenizer and env, checked against the model
  run                      build(config): the one place a config becomes objects
  adapter_stream           config.lora on the root: the base once, the adapters each version
  export                   trained weights as an HF checkpoint, adapters as a PEFT adapter
  watch                    what an update's episodes say: rollout stats, the infra-failure stop
  core                     a run's state (Run, setup, initial params), which both loops share
  sft                      the SFT warm start
  report                   evaluations, each update's alarms, the run's summary
  grpo_update              the GRPO learner and one update
  fidelity                 re-scoring tokens with the version that sampled them
  lockstep                 the lockstep loop (rollout, then update, in one process)
  host                     an async rollout host
  async_loop               the async trainer
  launch                   the async trainer with rollout-host processes started beside it
"""

LAYERS = ("npz", "metrics", "layout", "wire", "work_queue", "queue_owner", "queue_client",
          "lineage", "rollout", "evaluate", "config_error", "recipe", "env_setup", "run",
          "adapter_stream", "export", "watch", "core", "sft", "report", "grpo_update",
          "fidelity", "lockstep", "host", "async_loop", "launch")
