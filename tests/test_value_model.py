"""Value model (critic): V = 0 at init, exact warm start from the policy trunk, own safetensors files."""

import json

import pytest
import torch
from safetensors import safe_open

from framework.errors import FwError
from framework.models import (
    Qwen3ForCausalLM,
    Qwen3ValueModel,
    load_pretrained,
    load_value_model,
    save_pretrained,
    save_value_model,
)
from framework.models.qwen3_config import Qwen3Config

CONFIG = {"vocab_size": 60, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}


def policy(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def trained_critic(seed: int = 0) -> tuple[Qwen3ValueModel, torch.Tensor]:
    critic = Qwen3ValueModel.from_policy(policy(seed))
    ids = torch.randint(0, 60, (3, 7), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    loss = (critic(ids) - torch.arange(7.0)).pow(2).mean()
    loss.backward()
    opt.step()
    return critic, ids


def test_values_are_exactly_zero_at_init():
    critic = Qwen3ValueModel(Qwen3Config.from_hf(CONFIG))
    ids = torch.randint(0, 60, (2, 9))
    values = critic(ids)
    assert values.shape == (2, 9) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(2, 9))
    assert values.requires_grad   # the head trains from zero
    assert Qwen3ValueModel.from_policy(policy()).v_head.weight.abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_start_copies_the_trunk_exactly(dtype):
    pol = policy().to(dtype)
    critic = Qwen3ValueModel.from_policy(pol)
    ours, theirs = critic.model.state_dict(), pol.model.state_dict()
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].dtype == dtype and torch.equal(ours[name], theirs[name]), name
        assert ours[name].data_ptr() != theirs[name].data_ptr()   # a copy, not shared storage
    assert torch.equal(critic(torch.zeros(1, 3, dtype=torch.long)), torch.zeros(1, 3))
    with torch.no_grad():
        critic.model.norm.weight.add_(1.0)
    assert not torch.equal(critic.model.norm.weight, pol.model.norm.weight)


def test_head_reads_the_policy_hidden_states():
    critic, ids = trained_critic()
    pol = policy()   # same seed: the policy the critic started from
    assert critic.v_head.weight.abs().sum() > 0
    # the first step leaves the trunk alone (its gradient flows through the zero head) ...
    for (n, a), (m, b) in zip(critic.model.state_dict().items(), pol.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # ... so the values are the policy's final hidden states through the trained head
    with torch.no_grad():
        hidden = pol(ids, return_hidden=True)
        assert torch.allclose(critic(ids), hidden @ critic.v_head.weight[0] + critic.v_head.bias[0], atol=1e-6)


def test_head_runs_in_float32_under_autocast():
    """Under bf16 autocast (bf16-mixed) the trunk computes in bfloat16 but the head does not: the values are the
    trunk's hidden states through the head in float64, to float32 rounding."""
    critic = Qwen3ValueModel.from_policy(policy())
    with torch.no_grad():
        critic.v_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        critic.v_head.bias.fill_(3.3)
    ids = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = critic.model(ids)
        values = critic(ids)
    want = hidden.double() @ critic.v_head.weight[0].double() + critic.v_head.bias[0].double()
    assert values.dtype == torch.float32
    assert (values.double() - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_head_computes_in_float32_or_the_float64_trunks_dtype(dtype):
    """A float64 critic (precision 64-true) gets float64 values: the trunk's hidden states through the head by hand in
    float64, to float64 rounding. A bf16 trunk without autocast (bf16-true) still gets float32 values, to float32
    rounding of the same float64 maths."""
    critic = Qwen3ValueModel.from_policy(policy(), dtype=dtype)
    with torch.no_grad():
        critic.v_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        critic.v_head.bias.fill_(1 / 3)
    ids = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = critic.model(ids).double()
        values = critic(ids)
    want = hidden @ critic.v_head.weight[0].double() + critic.v_head.bias[0].double()
    assert values.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(values.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_warm_start_in_another_dtype_copies_the_trunk_exactly():
    """A critic in float32 from a bfloat16 policy (LoRA's critic on a bfloat16 base) holds the same values."""
    pol = policy().to(torch.bfloat16)
    critic = Qwen3ValueModel.from_policy(pol, torch.float32)
    theirs = pol.model.state_dict()
    for name, tensor in critic.state_dict().items():
        assert tensor.dtype == torch.float32, name
        if name.startswith("model."):
            assert torch.equal(tensor, theirs[name.removeprefix("model.")].float()), name


def test_policy_class_is_not_bent():
    pol = policy()
    assert not hasattr(pol, "v_head")
    assert not any(k.startswith("v_head") for k in pol.hf_state_dict())


def test_save_and_load_round_trip(tmp_path):
    critic, ids = trained_critic()
    save_value_model(critic, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ValueModel"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"v_head.weight", "v_head.bias", "model.embed_tokens.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= names and "lm_head.weight" not in names
    again = load_value_model(tmp_path)
    for (n, a), (m, b) in zip(critic.state_dict().items(), again.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    with torch.no_grad():
        assert torch.equal(again(ids), critic(ids))
    assert load_value_model(tmp_path, dtype="bfloat16").v_head.weight.dtype == torch.bfloat16


def test_value_and_policy_directories_are_not_confused(tmp_path):
    save_pretrained(policy(), tmp_path / "policy")
    save_value_model(Qwen3ValueModel.from_policy(policy()), tmp_path / "value")
    with pytest.raises(FwError, match="value model.*load_value_model"):
        load_pretrained(tmp_path / "value")
    with pytest.raises(FwError, match="is not \\['Qwen3ValueModel'\\]"):
        load_value_model(tmp_path / "policy")
    critic = Qwen3ValueModel.from_policy(policy())
    sd = {k: v for k, v in critic.hf_state_dict().items() if k != "v_head.bias"}
    with pytest.raises(FwError, match=r"missing tensors \['v_head.bias'\]"):
        critic.load_hf_state_dict(sd)
