"""What only a CUDA GPU runs: torch's varlen FlashAttention under packing,
Liger-Kernel's fused linear cross-entropy, bitsandbytes' 8-bit and paged AdamW
on the GPU. Skipped without one (CI has none); run on a GPU machine with
`python -m pytest tests/training/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from llmcustoms.losses import sft

from llmcustoms.models import packing
from llmcustoms.training.batching import collate
from llmcustoms.runs.checkpoints import flatten_optimizer_state, unflatten_optimizer_state
from llmcustoms.losses.sft import select_logits, token_cross_entropy
from llmcustoms.models.packing import pack, use_varlen_attention
from llmcustoms.data.tokenization import IGNORE_INDEX
from test_losses import rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def lora_model(directory, dtype=torch.bfloat16):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).cuda()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    select_logits(model.get_base_model())
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("family,dtype", [("llama", torch.bfloat16), ("qwen2", torch.bfloat16),
                                          ("llama", torch.float32)])  # fp32 weights: q and k arrive in fp32
def test_packed_rows_on_the_gpu_kernel_match_padded_rows(tiny_models, family, dtype, monkeypatch):
    model = lora_model(tiny_models[family], dtype)
    examples = rows(model.config.vocab_size)
    padded = {k: v.cuda() for k, v in collate(examples, 0).items()}
    normaliser = torch.tensor(float((padded["labels"][:, 1:] != IGNORE_INDEX).sum()), device="cuda")
    trained = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, _ = token_cross_entropy(model, padded, normaliser)
    expected_grads = torch.autograd.grad(expected, trained)

    use_varlen_attention(model.get_base_model())
    per_row = []
    monkeypatch.setattr(packing, "_per_row", lambda *a: per_row.append(1) or pytest.fail("not the GPU kernel"))
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in pack(examples).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = token_cross_entropy(model, packed, normaliser)
    grads = torch.autograd.grad(loss, trained)
    assert not per_row
    assert float(loss) == pytest.approx(float(expected), rel=2e-3)  # bf16
    assert max(relative(g, e) for g, e in zip(grads, expected_grads)) < 3e-2


def test_liger_fused_loss_matches_the_chunked_loss(tiny_models, monkeypatch):
    pytest.importorskip("liger_kernel")
    model = lora_model(tiny_models["qwen2"])
    batch = {k: v.cuda() for k, v in collate(rows(model.config.vocab_size), 0).items()}
    normaliser = torch.tensor(float((batch["labels"][:, 1:] != IGNORE_INDEX).sum()), device="cuda")
    trained = [p for p in model.parameters() if p.requires_grad]
    used = []
    original = sft._liger_loss
    monkeypatch.setattr(sft, "_liger_loss", lambda *a: used.append(1) or original(*a))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused, _ = token_cross_entropy(model, batch, normaliser)
    fused_grads = torch.autograd.grad(fused, trained)
    assert used and fused.dtype == torch.float32
    monkeypatch.setattr(sft, "_liger_loss", lambda *a: None)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain, _ = token_cross_entropy(model, batch, normaliser)
    plain_grads = torch.autograd.grad(plain, trained)
    assert float(fused) == pytest.approx(float(plain), rel=2e-3)
    assert max(relative(g, e) for g, e in zip(fused_grads, plain_grads)) < 3e-2


@pytest.mark.parametrize("kind", ("AdamW8bit", "PagedAdamW", "PagedAdamW8bit"))
def test_bitsandbytes_optimizers_save_and_restore_exactly_on_the_gpu(kind):
    import bitsandbytes as bnb

    def steps(params, optimizer, seed, count):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(count):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=generator)
            optimizer.step()

    # 512 x 256 entries: over bitsandbytes' thresholds for 8-bit moments (4,096) and paging (100,000).
    params = [torch.nn.Parameter(torch.randn(512, 256, device="cuda")), torch.nn.Parameter(torch.randn(64, device="cuda"))]
    optimizer = getattr(bnb.optim, kind)(params, lr=1e-3)
    steps(params, optimizer, 0, 3)
    assert getattr(optimizer.state[params[0]]["state1"], "is_paged", False) == kind.startswith("Paged")
    tensors, groups = flatten_optimizer_state(optimizer.state_dict())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = getattr(bnb.optim, kind)(copies, lr=1e-3)
    restored.load_state_dict(unflatten_optimizer_state({k: v.cpu() for k, v in tensors.items()}, groups))
    steps(params, optimizer, 1, 2)
    steps(copies, restored, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(params, copies))
