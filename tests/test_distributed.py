"""Precompute and train on 2 CPU processes over gloo, started by torchrun as a user starts them: the same cache
and, in float32, the same adapter as one process doing the same work; resume; the out-of-memory back-off."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_DATA, cached, sequences_of
from safetensors.torch import load_file

from lowmem_dpo import precompute, sft, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.data import cache
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.weights import card_host_bytes
from lowmem_dpo.objectives.metrics import LOSS
from lowmem_dpo.runtime import distributed, ranks
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training.step import Sums

# Small, exact and quick: float32 on the tiny model, 6 steps of 8 pairs, eval and checkpoints every 3 steps; a
# constant learning rate.
KEYS = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), device="cpu", dtype="float32",
            max_length=64, precompute_batch_size=16, cache_shard_rows=48, learning_rate=1e-3, seed=0,
            eval_fraction=0.15, eval_steps=3, save_steps=3, logging_steps=1, eval_generations=2,
            max_new_tokens=8, max_steps=6, lr_scheduler_type="constant")


def torchrun(stage: str, recipe: Path, *overrides: str, script: Path | None = None) -> subprocess.CompletedProcess:
    """python -m torch.distributed.run --standalone --nproc-per-node 2 -m lowmem_dpo.STAGE RECIPE KEY=VALUE..."""
    target = [str(script)] if script else ["-m", f"lowmem_dpo.{stage}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 processes on 2 cores
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *target, str(recipe), *overrides], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600)


def adapter(out: Path) -> dict:
    return load_file(out / "adapter_model.safetensors")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def assert_same_adapter(a: Path, b: Path, atol: float = 1e-4) -> None:
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < atol


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_path):
    """A folder and the recipe the tests share (each test builds what it needs of it: under xdist a module's tests
    may run on two workers, and a fixture that trained would train on both)."""
    root = tmp_path_factory.mktemp("dist")
    recipe = root / "recipe.yaml"
    recipe.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in KEYS.items()), encoding="utf-8")
    return root, recipe


def one_process(root: Path, recipe: Path, train_too: bool = False) -> Path:
    """The recipe's cache from one process (root/cache1) and, with train_too, one process's 6-step run at
    per_device_train_batch_size=4 (root/one: what the 2-process runs at 2 per device must equal); built once."""
    one = load_config(recipe, [f"ref_cache_dir={root / 'cache1'}", f"output_dir={root / 'one'}",
                               "per_device_train_batch_size=4", "gradient_accumulation_steps=2"])
    if not (root / "cache1").is_dir():
        precompute.run(one, progress=False)
    if train_too and not (root / "one" / "adapter_model.safetensors").is_file():
        train.run(one, progress=False)
    return root / "cache1"


def test_precompute_on_two_processes_equals_one_and_computes_only_what_is_missing(run):
    """With sequences deleted from one process's store (a killed build's aftermath, made by hand), 2 processes
    split what is missing between them and compute only that, committing to the one store: the values equal one
    process's. Here with the reference sharded over them (fsdp=true: every forward gathers each layer from both, so
    a process with fewer batches runs idle ones); docs/several-processes.md's torchrun precompute, data parallel,
    runs in test_doc_blocks.py."""
    root, recipe = run
    two = root / "cache2"
    shutil.copytree(one_process(root, recipe), two)
    cfg1 = load_config(recipe, [f"ref_cache_dir={root / 'cache1'}"])
    cfg2 = load_config(recipe, [f"ref_cache_dir={two}"])
    total = len(sequences_of(cfg2))
    with cache.open_store(two) as store:
        store.db.execute("DELETE FROM sequences WHERE key IN (SELECT key FROM sequences LIMIT 100)")
        store.db.commit()
    p = torchrun("precompute", recipe, f"ref_cache_dir={two}", "fsdp=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count(f"computed 100 sequences, reused {total - 100}") == 1  # rank 0 reports, once
    assert "fsdp: 2 decoder layers and the embeddings sharded over 2 processes" in p.stderr
    a, c = cached(cfg1)[0], cached(cfg2)[0]
    assert (a.chosen - c.chosen).abs().max() < 1e-5 and (a.rejected - c.rejected).abs().max() < 1e-5


OOM_SCRIPT = '''"""Rank 1 runs out of memory (simulated: CUDA OOM cannot happen on this CPU) in its first forward of step 2."""
import glob
import os
import sys

import torch

from lowmem_dpo import train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.runtime import distributed
from lowmem_dpo.training.objective import Pairs

real, calls = Pairs.forward, {"n": 0}


def pair_forward(objective, model, pairs, *args, **kwargs):
    calls["n"] += torch.is_grad_enabled()  # a training forward (the eval's run without gradients)
    if os.environ["RANK"] == "1" and calls["n"] == 3 and torch.is_grad_enabled():  # step 1 took 2 micro-batches
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return real(objective, model, pairs, *args, **kwargs)


Pairs.forward = pair_forward  # every Pairs' forward, the run's too
code = run_cli(train.main, sys.argv[1:], "train", "")
# As at exit: the group's gloo threads must end here, while Python runs, whatever the run imported after init
# (transformers' model loading imports torch.distributed.nn, whose defaults would otherwise keep the group alive
# into the interpreter's teardown, where a finished rank sometimes aborted with exit -6).
distributed.leave()
names = sorted(open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
sys.stdout.flush()
os.write(1, f"threads after leave: {names}\\n".encode())  # one write: the ranks share the pipe
sys.exit(code)
'''


def test_train_on_two_processes_equals_one_at_twice_the_batch_through_an_out_of_memory(run, capsys):
    """2 processes at per_device_train_batch_size=2 take the same 8 pairs a step as 1 at 4: the same metrics
    (eval included) and, in float32, the same adapter within 1e-4; one process may not resume it. Rank 1 alone
    runs out of memory at step 2: both ranks halve to 1 pair per micro-batch (a rank that went on alone would wait
    forever in the gradient sum), and the step's update is the same. At the end, leave() ends each rank's gloo
    threads. (A resumed 2-process run equals its uninterrupted self: the dropout test below, where each rank's
    random state counts.)"""
    root, recipe = run
    cache1, out = one_process(root, recipe, train_too=True), root / "two"
    script = root / "oom_rank1.py"
    script.write_text(OOM_SCRIPT, encoding="utf-8")
    keys = [f"ref_cache_dir={cache1}", f"output_dir={out}", "per_device_train_batch_size=2",
            "gradient_accumulation_steps=2"]
    p = torchrun("train", recipe, *keys, script=script)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "out of memory at step 2: retrying with per_device_train_batch_size=1 gradient_accumulation_steps=4" \
        in p.stderr
    assert_same_adapter(root / "one", out)
    one, two = metrics(root / "one"), metrics(out)
    assert [m["step"] for m in one] == [m["step"] for m in two]
    for a, b in zip(one, two):
        for k in ("loss", "rewards/margins", "grad_norm", "eval_loss", "eval_rewards/accuracies"):
            assert (a.get(k) is None) == (b.get(k) is None) and (a.get(k) is None or abs(a[k] - b[k]) < 1e-4), k
    assert p.stderr.count("saved adapter to") == 1 and "process 0 of 2" in p.stderr
    left = [line for line in p.stdout.splitlines() if line.startswith("threads after leave:")]
    assert len(left) == 2 and not any("gloo" in line for line in left), left  # a whole train's imports
    assert len(list((out / "checkpoints").iterdir())) == 2 and (out / "samples.jsonl").is_file()
    assert json.loads((out / "checkpoints/checkpoint-6/trainer_state.json").read_text())["world_size"] == 2

    code = run_cli(train.main, [str(recipe), *keys, "max_steps=10"], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and "written by a run on 2 process(es), this one has 1" in err and "Traceback" not in err


def test_a_resumed_two_process_run_with_dropout_equals_the_uninterrupted_one(run):
    """lora_dropout 0.1: each rank draws its own masks, so each rank's random state is saved and restored. A
    2-process run killed after its step-3 checkpoint (its aftermath: that checkpoint alone in a fresh output_dir)
    and resumed ends with the uninterrupted 6-step run's adapter, bit for bit. Both with fsdp=true: the base
    sharded, the adapter gathered whole into rank 0's checkpoint (data parallel saves and resumes the same way)."""
    root, recipe = run
    rows = [json.loads(line) for line in open(TINY_DATA)][:96]
    for i, row in enumerate(rows):  # lengths that differ from pair to pair: each rank draws masks of its own size
        row["chosen"] += " very" * (i % 7)
        row["rejected"] += " quite" * (i % 5)
    data = root / "uneven.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    keys = [f"dataset={data}", f"ref_cache_dir={root / 'cache-uneven'}", "per_device_train_batch_size=2",
            "gradient_accumulation_steps=2", "lora_dropout=0.1", "eval_fraction=0", "fsdp=true"]
    precompute.run(load_config(recipe, keys), progress=False)
    whole, resumed = root / "dropout-whole", root / "dropout-resumed"
    p = torchrun("train", recipe, *keys, f"output_dir={whole}")
    assert p.returncode == 0, p.stderr[-3000:]
    rng = torch.load(whole / "checkpoints/checkpoint-3/rng.pt", weights_only=True)
    assert len(rng["ranks"]) == 2 and not torch.equal(rng["ranks"][0]["cpu"], rng["ranks"][1]["cpu"])
    shutil.copytree(whole / "checkpoints/checkpoint-3", resumed / "checkpoints/checkpoint-3")
    p = torchrun("train", recipe, *keys, f"output_dir={resumed}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stderr
    want, got = adapter(whole), adapter(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


FSDP_SCRIPT = '''"""train's main, once per run listed in the JSON file argv[1]; each rank prints its 4-bit bytes (the
uint8 weights: nothing else is uint8) before and after sharding. A run with "corrupt" overwrites rank 1's shard of
one 4-bit weight with random bytes after sharding (a damaged file on one machine: simulated, as no file here is)."""
import json
import os
import sys

import torch

from lowmem_dpo import train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.runtime import sharding
from lowmem_dpo.training import policy

real, corrupt = policy.shard_over_ranks, {"on": False}


def local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def shard_over_ranks(model, resolved):
    four = [p for p in model.parameters() if p.dtype == torch.uint8]
    before = sum(p.numel() * p.element_size() for p in four)
    real(model, resolved)
    four = [local(p) for p in model.parameters() if p.dtype == torch.uint8]
    after = sum(p.numel() * p.element_size() for p in four)
    shards = sharding.local_bytes(model, shards_only=True)
    os.write(1, f"rank {os.environ['RANK']}: 4-bit bytes {before} local {after} shards {shards}\\n".encode())
    if corrupt["on"] and os.environ["RANK"] == "1":
        four[0].copy_(torch.randint(0, 256, four[0].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))


policy.shard_over_ranks = shard_over_ranks
for one in json.load(open(sys.argv[1])):
    corrupt["on"] = one["corrupt"]
    code = run_cli(train.main, one["args"], "train", "")
    if code:
        sys.exit(code)
'''


def test_fsdp_trains_as_one_process_in_4bit_and_unquantized_and_a_corrupted_shard_shows_at_step_1(run):
    """fsdp=true on 2 processes at per_device_train_batch_size=2: the adapter of 1 process at 4 within 1e-4, with a
    4-bit base (lowmem_dpo:tiny-llama, quantization=4bit) and unquantized; each rank holds half of the base's 4-bit
    bytes, and the shards the plan counts (weights.card_host_bytes). 33 eval pairs split 17/16, 9 micro-batches
    against 8: rank 1 runs an idle forward in each eval (without it, the run would hang). A run whose rank 1 holds
    a corrupted shard warns at step 1 (the drift line), naming fsdp."""
    root, recipe = run
    cache1 = one_process(root, recipe, train_too=True)
    four = [f"ref_cache_dir={root / 'cache4'}", "quantization=4bit"]
    if not (root / "one4" / "adapter_model.safetensors").is_file():
        one4 = load_config(recipe, [*four, f"output_dir={root / 'one4'}", "per_device_train_batch_size=4",
                                    "gradient_accumulation_steps=2"])
        precompute.run(one4, progress=False)
        train.run(one4, progress=False)
    two = ["per_device_train_batch_size=2", "gradient_accumulation_steps=2", "fsdp=true", "eval_max_pairs=33"]
    runs = [{"args": [str(recipe), *four, *two, f"output_dir={root / 'fsdp4'}"], "corrupt": False},
            {"args": [str(recipe), f"ref_cache_dir={cache1}", *two, f"output_dir={root / 'fsdp'}"], "corrupt": False},
            {"args": [str(recipe), *four, *two, f"output_dir={root / 'fsdp-bad'}", "max_steps=1", "eval_fraction=0",
                      "save_steps=0"], "corrupt": True}]
    (root / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
    script = root / "fsdp_runs.py"
    script.write_text(FSDP_SCRIPT, encoding="utf-8")
    p = torchrun("train", root / "runs.json", script=script)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_adapter(root / "one4", root / "fsdp4")  # export, GGUF and chat read it as any other: the same
    assert (root / "one4/adapter_config.json").read_text() == (root / "fsdp4/adapter_config.json").read_text()
    assert_same_adapter(root / "one", root / "fsdp")
    bytes_lines = [line.split() for line in p.stdout.splitlines() if line.startswith("rank ")]
    four_bit = {int(w[1].rstrip(":")): (int(w[4]), int(w[6]), int(w[8])) for w in bytes_lines[:2]}  # run 1's ranks
    (whole, r0, shards), (_, r1, _) = four_bit[0], four_bit[1]
    assert whole > 0 and r0 + r1 == whole and abs(r0 - whole / 2) < 0.01 * whole  # dim-0 chunks: rows, not bytes
    planned = card_host_bytes(load_arch("lowmem_dpo:tiny-llama"), "float32", "4bit", 2)
    assert abs(shards - planned) < 0.02 * planned, (shards, planned)
    assert p.stderr.count("the base sharded (fsdp); the") == 3  # each run's one resolved line (rank 0's)
    assert "# resolved fsdp=true (from the recipe): the frozen weights sharded over the processes" in (
        root / "fsdp" / "config.yaml").read_text()
    assert p.stderr.count("warning: step 1: reference cache off this policy's forward") == 1  # the corrupted run's alone
    assert "with fsdp, a process whose shard of the base differs" in p.stderr


def test_sft_on_two_processes_equals_one_at_twice_the_batch(run):
    """sft's loss is the mean NLL over all of a step's completion tokens, every rank's."""
    root, _ = run
    keys = ["dtype=float32", "max_steps=3", "learning_rate=1e-3", "logging_steps=1", "save_steps=0"]
    p = torchrun("sft", "lowmem_dpo:tiny-sft", *keys, f"output_dir={root / 'sft2'}",
                 "per_device_train_batch_size=2")
    assert p.returncode == 0, p.stderr[-3000:]
    code = run_cli(sft.main, ["lowmem_dpo:tiny-sft", *keys, f"output_dir={root / 'sft1'}",
                              "per_device_train_batch_size=4"], "sft", "")
    assert code == 0
    assert_same_adapter(root / "sft1", root / "sft2")
    assert [m["loss"] for m in metrics(root / "sft1")] == pytest.approx([m["loss"] for m in metrics(root / "sft2")],
                                                                        abs=1e-5)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="accelerate launch --cpu starts its processes with mpirun "
                    "(OpenMPI: apt install openmpi-bin); not installed here")
def test_accelerate_launch_on_a_cpu_runs_through_mpirun(run, tmp_path):
    """accelerate launch --cpu --num_processes 2 --mpirun_hostfile: mpirun's ranks (OMPI_COMM_WORLD_*), the same
    adapter as torchrun's 2 processes."""
    root, recipe = run
    one_process(root, recipe, train_too=True)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = tmp_path / "acc"
    p = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_processes", "2",
                        "--num_machines", "1", "--mpirun_hostfile", str(hosts), "--mixed_precision", "no",
                        "--dynamo_backend", "no", "-m", "lowmem_dpo.train", str(recipe),
                        f"ref_cache_dir={root / 'cache1'}", f"output_dir={out}", "per_device_train_batch_size=2",
                        "gradient_accumulation_steps=2"], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "process 0 of 2" in p.stderr and p.stderr.count("saved adapter to") == 1  # mpirun's rank 1 is quiet
    assert_same_adapter(root / "one", out)


def test_world_comes_from_the_launchers_environment(monkeypatch):
    for name in [n for names in ranks.ENV_NAMES for n in names] + ["ACCELERATE_MIXED_PRECISION", "MASTER_ADDR"]:
        monkeypatch.delenv(name, raising=False)
    assert distributed.world() == distributed.World(0, 1, 0) and not distributed.active()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")  # mpirun, as accelerate launch --cpu uses it
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert distributed.world() == distributed.World(3, 4, 0)
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name)
    # accelerate launch --num_processes 2 without --multi_gpu or mpirun starts one process: refused, not run as one
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UserError, match="started one process: on GPUs add --multi_gpu"):
        distributed.init(torch.device("cpu"))
    assert distributed.shard(list(range(7)), distributed.World(1, 3)) == [1, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL); none here")
def test_on_a_gpu_the_group_sums_gpu_gradients_and_cpu_flags(tmp_path):
    """One rank in the backend distributed.init picks on CUDA: the LoRA gradients (GPU tensors, NCCL) and the
    flags and metric sums (CPU tensors, gloo) both go through it."""
    device = torch.device("cuda", 0)
    torch.distributed.init_process_group(distributed.backend(device), init_method=f"file://{tmp_path / 'rdv'}",
                                         rank=0, world_size=1, device_id=device)
    try:
        p = torch.nn.Parameter(torch.ones(3, device=device))
        p.grad = torch.full((3,), 2.0, device=device)
        distributed.sum_gradients([p])
        assert p.grad.tolist() == [2.0, 2.0, 2.0]
        assert distributed.any_rank(True) and not distributed.any_rank(False)
        stats = Sums({LOSS.name: 1.5}, {LOSS.name: 3}, items=2, tokens=10, nll_weight=0.5)
        assert distributed.sum_stats(stats) == stats
        assert distributed.broadcast({"a": 1}) == {"a": 1}
        distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_kto_on_two_processes_finishes_with_an_odd_number_of_eval_blocks(run):
    """KTO on 2 processes, its 72 eval rows 5 blocks of 16 (rank 0 evaluates 3, rank 1 2): no call pairs across
    processes in a block (each process's z0 is its own block's), so nothing waits on another; both processes
    agree on the metrics (summed over the ranks)."""
    root, recipe = run
    keys = [f"ref_cache_dir={root / 'kto-cache'}", f"output_dir={root / 'kto'}", "loss_type=kto",
            "per_device_train_batch_size=16", "max_steps=2", "eval_steps=2", "save_steps=2"]
    precompute.run(load_config(recipe, keys), progress=False)  # in this process: its torchrun is tested above
    p = torchrun("train", recipe, *keys)
    assert p.returncode == 0, p.stderr[-3000:]
    evals = [m for m in metrics(root / "kto") if "eval_loss" in m]
    assert evals[-1]["step"] == 2 and evals[-1]["eval_pairs"] == 72 and evals[-1]["eval_loss"] > 0
