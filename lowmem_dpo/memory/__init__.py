"""The memory planner's parts, below the stages that use them (train, precompute) and the plan CLI:

    arch.py    a decoder's numbers from its config.json alone (no weights)
    setup.py   a Config resolved through the device rules into what a prediction depends on; the budget
    model.py   peak bytes of precompute and of a train step, term by term: pure functions of (Arch, Setup)
    search.py  the first plan that fits a budget (choose) and the CPU-offload device maps
"""
