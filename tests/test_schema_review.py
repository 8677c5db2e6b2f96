"""The schema's descriptions against what the code does with their keys."""

import json
from pathlib import Path

from framework.config import resolve
from framework.data import IGNORE, ExampleStream
from framework.tasks import build_task
from framework.tokenizer import Tokenizer
from recipes.grpo import GRPORecipe

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "schemas" / "train.schema.json").read_text())
DATA = SCHEMA["properties"]["data"]["properties"]


def _digits(recipe: str, **data) -> dict:
    return resolve({"recipe": recipe, "model": {"policy": {"preset": "tiny"}},
                    "data": {"task": {"name": "digits", "init_args": {"num_digits": 3}}, "chat_template": False,
                             **data},
                    "rollout": {"max_new_tokens": 5}})


def test_data_max_seq_len_is_described_as_sft_only():
    """GRPO's rows are a whole prompt plus up to rollout.max_new_tokens tokens whatever data.max_seq_len says, so
    the key must not promise RL users that it bounds or truncates their rows."""
    tok = Tokenizer.builtin()
    prompt = len(tok.encode(build_task(_digits("grpo")["data"], seed=0).sample(0)["prompt"]))   # "ddd=": 4 tokens
    for limit in (2, 512):
        shapes = GRPORecipe.batch_shapes(_digits("grpo", max_seq_len=limit), tok)
        assert shapes.seq_len == prompt + 5 > 2
    for text in (DATA["max_seq_len"]["description"], DATA["max_seq_len"]["markdownDescription"]):
        assert text.startswith("SFT:") and "rollout.max_new_tokens" in text


def test_data_task_is_described_as_serving_sft_too():
    """An SFT run trains on a task's prompt -> answer pairs; the key's description named it an RL prompt source
    alone."""
    tok = Tokenizer.builtin()
    cfg = _digits("sft")
    sample = build_task(cfg["data"], seed=cfg["seed"]).sample(0)
    example = ExampleStream(cfg, tok, train_on_prompt=False)[0]
    trained = [t for t in example.targets if t != IGNORE]
    assert tok.decode(trained[:len(sample["answer"])]) == sample["answer"]
    task = DATA["task"]
    assert "SFT" in task["description"] and "SFT" in task["markdownDescription"]
    assert "my_pkg.tasks." in task["properties"]["class_path"]["markdownDescription"]


def _lines(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_rl_eval_file_gives_its_first_max_prompts_prompts(tmp_path):
    """eval.max_prompts: 'the first ones of the eval data that are not training prompts'. An RL eval.path was read
    in the seeded shuffled order data.shuffle gives the training file, so a file's first prompts were not the ones
    evaluated (an SFT eval.path was read in file order)."""
    from framework.evaluation import Evaluation

    train = _lines(tmp_path / "train.jsonl", [{"prompt": f"t{i}=", "answer": str(i)} for i in range(5)])
    # q3= is also a training prompt: held out, the next one takes its place
    held = _lines(tmp_path / "eval.jsonl", [{"prompt": f"q{i}=" if i != 3 else "t0=", "answer": str(i)}
                                            for i in range(20)])
    for shuffle in (True, False):
        cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}},
                       "data": {"path": train, "chat_template": False, "shuffle": shuffle},
                       "eval": {"path": held, "max_prompts": 4, "every_n_steps": 1}})
        assert Evaluation(cfg, Tokenizer.builtin()).texts == ["q0=", "q1=", "q2=", "q4="]
    assert "eval.path is read in file order" in DATA["shuffle"]["description"]
