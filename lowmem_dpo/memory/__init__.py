"""The memory planner's parts, below the stages that use them (train, precompute) and the plan CLI:

    arch.py     a decoder's numbers from its config.json alone (no weights)
    arch_source.py  where a model's config.json comes from; archs/ holds architecture-only configs of 7B/8B
                models for planning offline
    setup.py    a Config resolved through the device rules into what a prediction depends on; the budget
    weights.py  the base's, LoRA's and the optimizer's bytes: pure
    activations.py  the activations' bytes, term by term: pure
    model.py    peak bytes of precompute and of a train step, term by term: pure functions of (Arch, Setup)
    search.py   the first plan that fits a budget (choose: the knobs in order of cost), the layers to stream,
                the longest max_length that fits

Its face: model.predict and search.choose.
"""
