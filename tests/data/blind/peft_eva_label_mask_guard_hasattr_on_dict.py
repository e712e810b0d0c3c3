# PEFT (huggingface/peft#3247, commit c1478213a): EVA's prepare_model_inputs_fn_language_modeling guarded the label mask
# with hasattr(model_input, "labels") on a dict, so it was never applied: prompt tokens (labels == -100) fed the LoRA SVD init.
import sys
from dataclasses import dataclass, field
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class EvaConfig:
    rho: float = 1.0
    use_label_mask: bool = True
    label_mask_value: int = -100


@dataclass
class LoraConfig:
    r: int = 4
    target_modules: list = field(default_factory=lambda: ["q_proj"])
    eva_config: EvaConfig = field(default_factory=EvaConfig)


def prepare_model_inputs_fn_language_modeling(model_input, peft_config: LoraConfig):
    if not isinstance(model_input, dict):
        raise TypeError("When using `prepare_model_inputs_fn_language_modeling` inputs must be a dictionary")
    mask = model_input.get("attention_mask", torch.ones_like(model_input["input_ids"])).bool()
    if FIXED:
        use_labels = peft_config.eva_config.use_label_mask and ("labels" in model_input)
    else:
        use_labels = peft_config.eva_config.use_label_mask and hasattr(model_input, "labels")
    if use_labels:
        mask = torch.logical_and(mask, model_input["labels"] != peft_config.eva_config.label_mask_value)
    return mask.nonzero()


def prepare_layer_inputs_fn_language_modeling(layer_input, model_input, layer_name) -> torch.Tensor:
    if isinstance(layer_input, torch.Tensor):
        pass
    elif isinstance(layer_input, (tuple, list)):
        layer_input = layer_input[0]
    return layer_input[model_input.T.unbind()]


class SVDHook:
    """EVA SVDHook, one partial_fit on a single batch (PCA of the selected token inputs)."""

    def __init__(self, name, n_components):
        self.name, self.n_components, self.model_input = name, n_components, None
        self.components_ = None

    @torch.no_grad()
    def __call__(self, module, input, output):
        states = prepare_layer_inputs_fn_language_modeling(input, self.model_input, self.name).to(torch.float32)
        self.n_tokens = states.shape[0]
        centered = states - states.mean(0, keepdim=True)
        _, _, vh = torch.linalg.svd(centered, full_matrices=False)
        self.components_ = vh[: self.n_components]


class Attention(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, attention_mask):
        B, T, D = x.shape
        q, k, v = (p(x).view(B, T, self.h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o_proj(a.transpose(1, 2).reshape(B, T, D))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Attention(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = x + layer(x, attention_mask)
        return self.lm_head(x)


def get_eva_components(model, inputs, peft_config):
    hooks = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in peft_config.target_modules:
            hook = SVDHook(name, peft_config.r)
            hook.model_input = prepare_model_inputs_fn_language_modeling(inputs, peft_config)
            hooks[name] = (hook, module.register_forward_hook(hook))
    with torch.no_grad():
        model(**inputs)
    for hook, handle in hooks.values():
        handle.remove()
    return {name: h for name, (h, _) in hooks.items()}


# an SFT batch from a plain-dict collator: prompt tokens carry label -100, right padding
B, T = 3, 16
input_ids = torch.randint(1, 64, (B, T))
attention_mask = torch.ones(B, T, dtype=torch.long)
labels = input_ids.clone()
prompt_lens, lengths = [6, 9, 4], [16, 13, 11]
for b in range(B):
    labels[b, : prompt_lens[b]] = -100
    attention_mask[b, lengths[b]:] = 0
    labels[b, lengths[b]:] = -100
inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

model = TinyLM().eval()
cfg = LoraConfig()
hooks = get_eva_components(model, inputs, cfg)

# reference: PCA over response tokens only (attention_mask & labels != -100)
ref_sel = (attention_mask.bool() & (labels != -100)).nonzero()
ref_hooks = {}
for name, module in model.named_modules():
    if name in hooks:
        h = SVDHook(name, cfg.r)
        h.model_input = ref_sel
        ref_hooks[name] = (h, module.register_forward_hook(h))
with torch.no_grad():
    model(**inputs)
worst = 0.0
for name, h in hooks.items():
    ref = ref_hooks[name][0]
    ref_hooks[name][1].remove()
    d = torch.minimum((h.components_ - ref.components_).abs().amax(1), (h.components_ + ref.components_).abs().amax(1))
    worst = max(worst, d.max().item())
print("tokens used for EVA SVD:", hooks["layers.0.q_proj"].n_tokens, "(response tokens:", len(ref_sel), ")")
print("max |EVA lora_A components - response-only components| (sign-invariant):", f"{worst:.6f}")
