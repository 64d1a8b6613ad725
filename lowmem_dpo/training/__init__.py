"""A training stage's parts, shared by DPO (train.py), SFT (sft.py) and KTO:

    inputs.py       what a stage reads: the model folder, the tokenizer, the tokenized data (train and eval),
                    the inputs' digests and a run's cached reference values
    guards.py       DPO's warning signs from the logged metrics, step 1's drift line: pure
    answers.py      the answers' warning signs from the samples (collapse, drift, content): pure
    signs.py        a run of pairs' signs, with its loss and device read once (Pairs.signs)
    policy.py       the trained model: base + one LoRA adapter, optimizer and schedule, the planner's choices
    objective.py    the objectives as the loop runs them: the Objective kind, Pairs (DPO, the reference-free
                    ones) and Rows (SFT); each says what it needs per batch, its loss and metric sums, its units
    kto.py          KTO's objective (Blocks): unpaired rows in blocks, the KL reference point, each block's means
    step.py         the update, top to bottom (optimizer_step): the micro-batches, the out-of-memory back-off and
                    the sums it owns; what a step changes (Trainee) and sums (Sums)
    session.py      a run's state in three typed parts (its setup, the trainee, the progress); start or resume it
    loop.py         the one training loop: the steps and the lines around each (metrics, eval, checkpoints)
    checkpoint.py   full-state checkpoints: atomic write, resume, pruning
    resuming.py     which checkpoint a stage continues, refused on changed settings
    evaluation.py   eval inside a run: when, the eval line and samples, the collapse sign, the best checkpoint
    samples.py      greedy sample generations, samples.jsonl
    output.py       what a run writes into output_dir: the folder check, config.yaml, metrics.jsonl, the adapter
    trackers.py     report_to: the metrics to TensorBoard, trackio and wandb
    provenance.py   which base and adapters a trained adapter belongs on, checked against the files (export)
    located.py      what a folder chat is given holds: a model, or an adapter on its base (provenance)

Its face: inputs.prepare and inputs.load_data (a stage's model folder, tokenizer and rows), objective.Pairs and
Rows, kto.Blocks, session.start, loop.run.
"""
