import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The suite's models are tiny and CI has 2 cores: intra-op threads only contend with each other (and
# with the subprocesses some tests start, which inherit OMP_NUM_THREADS). One thread is faster and
# makes timings independent of the core count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def install_recipe(tmp_path, monkeypatch):
    """Install recipes for one test the way a package does: an `fw.recipes` entry point in a dist-info
    directory on sys.path. Call it with {name: "module:Class"}."""
    def install(recipes: dict[str, str], dist: str = "fw_test_recipes") -> None:
        info = tmp_path / "site" / f"{dist}-0.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
        lines = "".join(f"{name} = {target}\n" for name, target in recipes.items())
        (info / "entry_points.txt").write_text(f"[fw.recipes]\n{lines}")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))

    return install


# Lightning's TensorBoardLogger writes with torch.utils.tensorboard wherever the tensorboard package is installed,
# else with tensorboardX (fw's own dependency): two writers whose threads, file names and errors differ.
TENSORBOARD_WRITERS = ("tensorboardX", "torch")


def use_tensorboard_writer(monkeypatch, writer: str) -> None:
    """Make Lightning open `writer`'s SummaryWriter in this process (torch's needs the tensorboard package)."""
    import lightning.fabric.loggers.tensorboard as lightning_tensorboard

    if writer == "torch":
        pytest.importorskip("tensorboard")
    monkeypatch.setattr(lightning_tensorboard, "_TENSORBOARD_AVAILABLE", writer == "torch")


@pytest.fixture(params=TENSORBOARD_WRITERS)
def tensorboard_writer(request, monkeypatch):
    """Each of Lightning's two TensorBoard writers in turn, in this process; the writer's name."""
    use_tensorboard_writer(monkeypatch, request.param)
    return request.param


@pytest.fixture(scope="module")
def tok():
    """The built-in character tokenizer."""
    from framework.tokenizer import Tokenizer

    return Tokenizer.builtin()


def peaked_tiny_model(tok, seed: int = 0):
    """The tiny preset for `tok` with larger weights than the init: peaked, varied next-token distributions."""
    from framework.models import Qwen3ForCausalLM
    from framework.models.presets import preset_config

    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def model(tok):
    """The rollout engine tests' model."""
    return peaked_tiny_model(tok)


class OpLog(TorchDispatchMode):
    """The operators a block of code dispatches."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def quiet_lightning():
    """Lightning's INFO lines off: with fw run in-process, its log handler may hold an earlier test's stderr."""
    import logging

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    yield
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


def on_screen(text):
    """The lines a terminal shows for `text`, trailing blanks dropped: a carriage return moves to the start of the
    line, and what follows overwrites it; ESC [2K blanks the line."""
    lines, line, col = [], [], 0
    text = text.replace("\x1b[2K", "\x00")
    for ch in text:
        if ch == "\x00":
            line = [" "] * col
        elif ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    return lines + ["".join(line).rstrip()]


def interrupt_once_started(proc, marker, timeout_s: float = 60.0) -> None:
    """SIGINT to `proc` once file `marker` exists (the code to interrupt is running), or after `timeout_s`, or at
    once if `proc` has ended."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
