"""A training stage's parts, shared by DPO (train.py), SFT (sft.py) and KTO:

    inputs.py       what a stage reads: the model folder, the tokenizer, the tokenized data (train and eval),
                    the inputs' digests and a run's cached reference values
    guards.py       DPO's warning signs from the logged metrics, the generations' repetition: pure
    policy.py       the trained model: base + one LoRA adapter, optimizer and schedule, the planner's choices
    session.py      a run's state in three typed parts (its setup, the trainee, the progress); start or resume it
    update.py       what a step's gradients become: unscaled (float16), clipped, the update or a skip, the schedule
    loop.py         the one training loop: optimizer_step (one step, top to bottom), metrics, checkpoints
    checkpoint.py   full-state checkpoints: atomic write, resume, pruning
    resuming.py     which checkpoint a stage continues, refused on changed settings
    evaluation.py   eval inside a run: when, the eval line and samples, the collapse sign, the best checkpoint
    samples.py      greedy sample generations, samples.jsonl
    output.py       what a run writes into output_dir: the folder check, config.yaml, metrics.jsonl, the adapter
    trackers.py     report_to: the metrics to TensorBoard, trackio and wandb
    provenance.py   which base and adapters a trained adapter belongs on, checked against the files (export)
    kto.py          KTO's objective: unpaired rows in blocks, the KL reference point

Its face: inputs.prepare and inputs.load_data (a stage's model folder, tokenizer and rows), session.start,
loop.run.
"""
