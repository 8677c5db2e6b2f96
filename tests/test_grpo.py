"""GRPO on CPU: trainer logprobs vs rollout, the update's gradient vs an independent float64 computation,
policy-step counting, the reference model only when needed, exact resume."""
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from framework.callbacks import Callback
from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.models import build_policy, save_pretrained
from framework.module import FwModule
from framework.rollout import SamplingParams, generate
from framework.tokenizer import Tokenizer
from framework.trainer import fit
from recipes.rl import completion_logprobs

TIMING = {"tokens_per_s", "rollout/tokens_per_s", "rollout/seconds"}   # wall-clock dependent


def config(run_dir, callbacks=(), **sections):
    cfg = {
        "recipe": "grpo", "seed": 1, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"name": "digits", "init_args": {"num_digits": 2, "rule": "sum"}}, "chat_template": False},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 3, "temperature": 0.9},
        "reward": {"name": "numeric_match"},
        "grpo": {"group_size": 4},
        "optimizer": {"lr": 1e-2, "max_grad_norm": None},
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 100, "keep_last": None},
        "logging": {"csv": False, "tensorboard": False},
        "callbacks": list(callbacks),
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return resolve(cfg)


def test_trainer_logprobs_match_rollout_fp32():
    torch.manual_seed(0)
    tok = Tokenizer.builtin()
    model = build_policy({"path": None, "preset": "tiny", "dtype": None, "gradient_checkpointing": False,
                          "keep_logits": None, "lora": None, "compile": False}, tok)
    prompts = [tok.encode(t) for t in ("12=", "7+8=", "a", "hello there=")]
    temperature = 0.7
    ro = generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=temperature, top_k=5, top_p=0.9),
                  eos_ids=(tok.eos_id,), tokenizer=tok, seed=3)
    width = ro.logprobs.shape[1]
    mask = ro.completion_mask
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, ro.tokens, ro.prompt_lens, ro.completion_lens, width,
                                            temperature, with_entropy=True)
    # the rollout's behaviour logprobs (full softmax at T, though top-k/top-p restricted sampling)
    assert (logp - ro.logprobs)[mask].abs().max() <= 1e-5
    assert torch.all(logp[~mask] == 0)
    # an independent float64 reference from the full logits of a plain forward
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        full = torch.log_softmax(m64(ro.tokens) / temperature, dim=-1)
    for b in range(len(prompts)):
        p = int(ro.prompt_lens[b])
        for j in range(int(ro.completion_lens[b])):
            row = full[b, p + j - 1]
            assert abs(float(logp[b, j]) - float(row[ro.tokens[b, p + j]])) <= 1e-5
            assert abs(float(entropy[b, j]) + float((row.exp() * row).sum())) <= 1e-4


def token_logprobs(model, data, temperature):
    """Per-row lists of completion-token logprobs from a plain full forward (independent of the recipe)."""
    full = torch.log_softmax(model(data.tokens) / temperature, dim=-1)
    return [[full[b, int(data.prompt_lens[b]) + j - 1, data.tokens[b, int(data.prompt_lens[b]) + j]]
             for j in range(int(data.completion_lens[b]))] for b in range(data.tokens.shape[0])]


def hand_group_advantages(rewards: list[float], size: int, eps: float) -> list[float]:
    """GRPO's advantages by hand: (r - group mean) / (unbiased group std + eps), exactly 0 in a tied group."""
    adv = []
    for start in range(0, len(rewards), size):
        group = rewards[start:start + size]
        mean = sum(group) / size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (size - 1))
        adv += [0.0 if max(group) == min(group) else (r - mean) / (std + eps) for r in group]
    return adv


class LetterReward:
    """A dense, varied reward for random-init policies: the share of letters in the completion."""

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        return sum(c.isalpha() for c in completion) / max(len(completion), 1)


class GradProbe(Callback):
    """At policy step `step`, recomputes the GRPO loss gradient independently in float64 and compares."""

    results: ClassVar[list] = []

    def __init__(self, step: int):
        self.step = step

    def before_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy" or module.policy_version != self.step - 1:
            return
        cfg = module.cfg
        g, data = cfg["grpo"], module.recipe.last_rollout
        policy = copy.deepcopy(module.policy).double()
        with torch.no_grad():
            ref_lp = token_logprobs(copy.deepcopy(module.reference).double(), data, cfg["rollout"]["temperature"])
        lp = token_logprobs(policy, data, cfg["rollout"]["temperature"])
        # group advantages by hand: (r - group mean) / (unbiased group std + eps)
        rewards = data.rewards.double().tolist()
        size = g["group_size"]
        adv = []
        for start in range(0, len(rewards), size):
            group = rewards[start:start + size]
            mean = sum(group) / size
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (size - 1))
            adv += [(r - mean) / (std + g["adv_eps"]) for r in group]
        loss_terms, kl_terms, clipped = [], [], 0
        for b, tokens in enumerate(lp):
            per_tok, per_kl = [], []
            for j, logp in enumerate(tokens):
                ratio = torch.exp(logp - float(data.old_logp[b, j]))
                a = adv[b]
                low, high = 1 - g["clip_eps_low"], 1 + g["clip_eps_high"]
                per_tok.append(-torch.minimum(ratio * a, ratio.clamp(low, high) * a))
                clipped += int((ratio * a).item() > (ratio.clamp(low, high) * a).item())
                log_ratio = ref_lp[b][j] - logp
                per_kl.append(torch.exp(log_ratio) - log_ratio - 1)
            loss_terms.append(per_tok)
            kl_terms.append(per_kl)
        max_len = cfg["rollout"]["max_new_tokens"]
        loss = self.agg(loss_terms, g["loss_agg"], max_len) + g["kl_coef"] * self.agg(kl_terms, g["loss_agg"], max_len)
        loss.backward()
        got = dict(module.policy.named_parameters())
        worst = max(float((p.grad - got[n].grad.double()).abs().max() / p.grad.abs().max().clamp(min=1e-12))
                    for n, p in policy.named_parameters())
        GradProbe.results.append({"worst_rel": worst, "clipped": clipped})

    @staticmethod
    def agg(terms, mode, max_len):
        if mode == "token-mean":
            flat = [t for row in terms for t in row]
            return sum(flat) / len(flat)
        if mode == "seq-mean-token-mean":
            return sum(sum(row) / len(row) for row in terms) / len(terms)
        return sum(sum(row) / max_len for row in terms) / len(terms)


@pytest.mark.parametrize("loss_agg, micro", [("token-mean", 1), ("token-mean", 3), ("seq-mean-token-sum-norm", 2),
                                             ("seq-mean-token-mean", 3)])
def test_update_gradient_matches_float64_reference(tmp_path, loss_agg, micro):
    """Second update on one rollout (ratio != 1, clipping and the k3 KL active), micro-batched or not."""
    GradProbe.results = []
    probe = {"class_path": "test_grpo.GradProbe", "init_args": {"step": 2}}
    cfg = config(tmp_path / "run", [probe], reward={"name": None, "class_path": "test_grpo.LetterReward"},
                 grpo={"group_size": 4, "epochs": 2, "minibatches": 1, "clip_eps_low": 0.02, "clip_eps_high": 0.03,
                       "kl_coef": 0.5, "kl_estimator": "k3", "loss_agg": loss_agg},
                 trainer={"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False,
                          "accumulate_grad_batches": micro})
    trainer = fit(cfg)
    assert trainer.global_step == 2
    [result] = GradProbe.results
    assert result["clipped"] > 0   # the test exercises the clipped branch
    assert result["worst_rel"] < 1e-4


def test_max_steps_counts_policy_steps_and_metrics(tmp_path):
    # 2 epochs x 2 minibatches = 4 policy steps per rollout batch; max_steps 6 stops mid-rollout
    cfg = config(tmp_path / "run", grpo={"group_size": 4, "epochs": 2, "minibatches": 2},
                 trainer={"accelerator": "cpu", "max_steps": 6, "enable_progress_bar": False})
    trainer = fit(cfg)
    module = trainer.lightning_module
    assert trainer.global_step == 6 and module.policy_version == 6
    assert module.recipe.rollout_step == 2
    assert module.reference is None   # kl_coef 0: no reference model at all
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # metrics reach the loggers at the end of a rollout batch: after policy steps 4 and 6
    assert [r["step"] for r in records] == [4, 6]
    first = records[0]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "policy/clip_frac", "policy/approx_kl",
                "policy/entropy", "rollout/response_len", "mismatch/mean", "mismatch/max", "policy/surrogate",
                "policy/objective", "policy/adv_abs", "grad_norm"):
        assert key in first, key
    assert first["mismatch/max"] <= 1e-5 and first["policy_version"] == 4
    assert 0.0 <= first["reward/mean"] <= 1.0


@pytest.mark.gpu
def test_float32_on_cuda_samples_from_the_policy_the_trainer_scores(tmp_path):
    """The default train.yaml on a GPU (32-true, the engine and its decode graphs kept between rollouts): at every
    step the rollout's logprobs are the trainer's, as on CPU. A rollout that sampled from stale weights, or read
    another row's blocks, shows here as a mismatch that grows."""
    from framework.config import load_config

    cfg = load_config([str(Path(__file__).resolve().parents[1] / "train.yaml")],
                      [f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=4", "--trainer.accelerator=gpu",
                       "--trainer.devices=1", "--trainer.precision=32-true", "--trainer.enable_progress_bar=false",
                       "--logging.tensorboard=false"])
    fit(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    seen = [(r["step"], r["mismatch/mean"], r["mismatch/max"]) for r in records if "mismatch/max" in r]
    assert [step for step, _, _ in seen] == [1, 2, 3, 4]
    assert all(worst <= 1e-4 for _, _, worst in seen), seen


def test_reference_model_only_with_kl(tmp_path):
    module = FwModule(config(tmp_path / "a", grpo={"kl_coef": 0.05}))
    assert module.reference is not None
    assert not any(p.requires_grad for p in module.reference.parameters()) and not module.reference.training
    assert FwModule(config(tmp_path / "b")).reference is None


def test_bad_settings_are_reported(tmp_path):
    with pytest.raises(FwError, match="rollout.temperature"):
        FwModule(config(tmp_path / "a", rollout={"temperature": 0.0}))
    with pytest.raises(FwError, match="grpo.minibatches"):
        FwModule(config(tmp_path / "b", grpo={"group_size": 2, "minibatches": 16}))


class LateFlaw:
    """A user's task whose samples from index 5 on are `flaw` over a good one: fw validate's sample(0) passes."""

    def __init__(self, flaw: dict, seed: int = 0):
        self.flaw = flaw

    def sample(self, index):
        good = {"prompt": f"{index % 10}=", "answer": "1", "metadata": {"answer": "1"}}
        return {**good, **self.flaw} if index >= 5 else good

    def widest_prompts(self):
        return ["9="]


@pytest.mark.parametrize("flaw, problem", [
    ({"prompt": ""}, "prompt is an empty string"),
    ({"metadata": {}}, "metadata has no 'answer', which the reward 'numeric_match' reads (it is empty)"),
])
def test_fit_names_the_first_task_sample_it_cannot_use(tmp_path, flaw, problem):
    """Past the sample fw validate draws, fit stops at the first bad one with the task and its index (the second
    step's prompts are samples 4 to 7), not at generation ("prompt 4 is empty") or inside the reward."""
    cfg = config(tmp_path / "run", data={"task": {"class_path": "tests.test_grpo.LateFlaw",
                                                  "init_args": {"flaw": flaw}}, "chat_template": False})
    with pytest.raises(FwError) as caught:
        fit(cfg)
    assert str(caught.value) == f"data.task: LateFlaw.sample(5): {problem}"


def test_exact_resume(tmp_path):
    """Crash mid-rollout (after policy step 5 of 2 per rollout), resume from step 4: identical metrics
    for every step and identical final weights."""
    settings = {"grpo": {"group_size": 4, "minibatches": 2},
                "trainer": {"accelerator": "cpu", "max_steps": 8, "enable_progress_bar": False,
                            "log_every_n_steps": 1},
                "checkpoint": {"every_n_steps": 3, "keep_last": None}}
    straight = tmp_path / "straight"
    fit(config(straight, **settings))
    # saves come between rollout batches (2 policy steps each): at the end of the batch a multiple of 3 falls in
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "step-000004", "step-000006", "step-000008"]
    broken = tmp_path / "broken"
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 5}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config(broken, [crash], **settings))
    state = torch.load(broken / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert state["fw_recipe"] == {"rollout_step": 2, "prompt_position": 8} and state["policy_version"] == 4
    trainer = fit(config(broken, **settings), resume="last")
    assert trainer.global_step == 8 and trainer.lightning_module.recipe.rollout_step == 4

    def comparable(run):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]

    expected = comparable(straight)
    assert [r["step"] for r in expected] == [2, 4, 6, 8]
    assert comparable(broken) == expected
    a, b = (load_file(str(Path(run) / "checkpoints" / "step-000008" / "policy" / "model.safetensors"))
            for run in (straight, broken))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_math_example_runs_on_a_model_directory(tmp_path):
    """recipes/grpo_math.yaml as shipped, pointed at an HF-layout directory (random tiny weights + the
    built-in tokenizer) and shrunk: JSONL prompts through the chat template, numeric answer reward."""
    from framework.config import load_config

    tok = Tokenizer.builtin()
    model_dir = tmp_path / "model"
    policy = build_policy({"path": None, "preset": "tiny", "dtype": None, "gradient_checkpointing": False,
                           "keep_logits": None, "lora": None, "compile": False}, tok)
    save_pretrained(policy, model_dir)
    tok.save_pretrained(model_dir)
    root = Path(__file__).resolve().parent.parent
    cfg = load_config([str(root / "recipes" / "grpo_math.yaml")], [
        f"--model.policy.path={model_dir}", f"--data.path={root / 'recipes' / 'data' / 'math_sample.jsonl'}",
        f"--run_dir={tmp_path / 'run'}", "--rollout.prompts_per_step=2", "--rollout.max_new_tokens=6",
        "--grpo.group_size=2", "--grpo.overlong.buffer=3", "--trainer.max_steps=2", "--trainer.precision=32-true",
        "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.accumulate_grad_batches=1",
        "--model.policy.gradient_checkpointing=false", "--logging.tensorboard=false"])
    trainer = fit(cfg)
    assert trainer.global_step == 2
    module = trainer.lightning_module
    data = module.recipe.last_rollout
    # prompts went through the Qwen3 chat template: every row starts with <|im_start|>user
    start = tok.encode("<|im_start|>user")
    assert all(data.tokens[b, :len(start)].tolist() == start for b in range(data.tokens.shape[0]))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["step"] == 2 and "reward/mean" in records[-1]
    for key in ("rollout/rounds", "policy/tis_capped_frac", "policy/dual_clip_frac", "reward/overlong_penalty_mean"):
        assert key in records[-1], key   # the recommended options ran


class RankChecksum(Callback):
    """Writes each rank's policy checksum and prompts after every policy step to <run_dir>/rank<r>.jsonl."""

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.optimizer_role(optimizer) != "policy":
            return
        data = module.recipe.last_rollout
        record = {"step": module.policy_version,
                  "checksum": float(sum(p.detach().double().sum() for p in module.policy.parameters())),
                  "first_prompt": data.tokens[0, :int(data.prompt_lens[0])].tolist()}
        with open(Path(module.cfg["run_dir"]) / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.mark.slow
def test_two_processes_share_updates_and_split_prompts(tmp_path):
    """DDP with gloo on CPU: ranks draw different prompts, and the policy stays identical on both."""
    run = tmp_path / "run"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root / 'tests'}{os.pathsep}{root}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "framework", "fit", "--config", str(root / "train.yaml"), f"--run_dir={run}",
           "--trainer.max_steps=4", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu",
           "--trainer.enable_progress_bar=false", "--rollout.prompts_per_step=4", "--grpo.group_size=4",
           "--grpo.minibatches=2", "--logging.tensorboard=false",
           "--callbacks=[{class_path: test_grpo.RankChecksum}]"]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, timeout=300, capture_output=True)
    ranks = [[json.loads(line) for line in (run / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [r["step"] for r in ranks[0]] == [r["step"] for r in ranks[1]] == [1, 2, 3, 4]
    assert [r["checksum"] for r in ranks[0]] == [r["checksum"] for r in ranks[1]]
    assert ranks[0][0]["first_prompt"] != ranks[1][0]["first_prompt"] or ranks[0][2]["first_prompt"] != \
        ranks[1][2]["first_prompt"]


def test_kv_budget_changes_no_metric_of_a_run(tmp_path):
    """rollout.kv_cache_gib reaches the engine: a budget of a few blocks (rows wait for each other's blocks)
    trains exactly like an unbounded one, and one too small for a single row is refused naming the key."""
    from framework.models.presets import preset_config
    from framework.rollout.kv_cache import block_bytes

    model = preset_config("tiny", 300)   # the vocabulary does not change a block's size
    blocks = 6 * block_bytes(model, torch.float32, 16) / 2**30
    runs = {}
    for name, gib in (("unbounded", None), ("small", blocks)):
        cfg = config(tmp_path / name, rollout={"kv_cache_gib": gib, "block_size": 16})
        fit(cfg)
        runs[name] = [{k: v for k, v in r.items() if k not in TIMING}
                      for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    assert runs["small"] == runs["unbounded"] and len(runs["small"]) == 2
    # blocks of 8: a prompt and its 12 new tokens need two, and the smallest pool has one beside its scratch block
    tiny = config(tmp_path / "tiny", rollout={"kv_cache_gib": blocks / 100, "block_size": 8, "max_new_tokens": 12})
    with pytest.raises(FwError, match="kv_cache_gib"):
        fit(tiny)


class EngineProbe(Callback):
    """Records, after every step, which rollout engine and KV pool the recipe holds (None: handed back)."""

    seen: ClassVar[list] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        engine = module.recipe.engine
        EngineProbe.seen.append(None if engine is None or engine.cache is None
                                else (id(engine), engine.cache.k.data_ptr()))


@pytest.mark.parametrize("keep", [True, False])
def test_keep_engine_keeps_one_pool_for_the_run_and_changes_no_metric(tmp_path, keep):
    """rollout.keep_engine true: one engine and one KV pool from the first rollout to the last, handed back at
    the end of the fit; false: none held between steps. Both train exactly like the default ("auto", which on
    CPU with no memory limit keeps it)."""
    probe = {"class_path": "test_grpo.EngineProbe"}
    EngineProbe.seen = []
    trainer = fit(config(tmp_path / "run", [probe], rollout={"keep_engine": keep}, trainer={"max_steps": 3}))
    seen = EngineProbe.seen
    assert len(seen) == 3
    if keep:
        assert seen[0] is not None and seen == [seen[0]] * 3
    else:
        assert seen == [None] * 3
    assert trainer.lightning_module.recipe.engine is None   # released when the fit ends
    fit(config(tmp_path / "auto", trainer={"max_steps": 3}))
    metrics = [[{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(d / "metrics.jsonl")]
               for d in (tmp_path / "run", tmp_path / "auto")]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 3
