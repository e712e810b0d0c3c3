# Citation: axolotl-ai-cloud/axolotl commit 507eee7aa ("fix(gemma4): packing-aware mask for hybrid-attention
#   global layers").
# Upstream: src/axolotl/loaders/patch_manager.py PatchManager._apply_gemma_hybrid_attention and
#   src/axolotl/monkeypatch/gemma4_hybrid_mask.py (patch_gemma4_hybrid_mask, hybrid_create_causal_mask,
#   _register_global_packed_sdpa); core/trainers/base.py AxolotlTrainer.compute_loss (its attention_mask drop
#   for gemma4 model types under sample packing). The model here is Gemma4ForCausalLM (model_type gemma4_text).
# Bug: with gemma4_hybrid_attn_impl the model is loaded with flash_attention_2 and every full_attention
#   (global, head_dim too large for FA2) layer gets a config copy with _attn_implementation="sdpa". Under
#   sample packing the model hands those layers attention_mask=None, the document boundaries living only in
#   position_ids, which the FA2 sliding layers turn into cu_seqlens and SDPA never reads, so the global layers
#   ran plain causal attention across the packed documents.
# Fix: the global layers get the registered "sdpa_global_packed" implementation, which, when its mask is None
#   and position_ids restart more than once per row, builds the block-diagonal causal mask from position_ids.
# Here flash-attn does not run on CPU: a plain-torch stand-in for its varlen kernel (cu_seqlens from
#   position_ids, window (w - 1, w - 1), causal) is registered under "flash_attention_2".
# Upstream's use_gqa_in_sdpa head_dim guard (a kernel-choice patch) is not ported.
import copy
import importlib
import sys

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---------------------------------------------------------------- flash-attn varlen stand-in (CPU)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1)):
    # q: (total, nheads, d), k/v: (total, nheads_k, d)
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * softmax_scale
        L = e - s
        i = torch.arange(L)[:, None]
        j = torch.arange(L)[None, :]
        keep = torch.ones(L, L, dtype=torch.bool)
        if causal:
            keep &= j <= i
        if window_size[0] >= 0:
            keep &= j >= i - window_size[0]
        if window_size[1] >= 0:
            keep &= j <= i + window_size[1]
        scores = scores.masked_fill(~keep, float("-inf"))
        out[s:e] = torch.matmul(scores.softmax(-1), vs).transpose(0, 1)
    return out


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    # transformers' FA2 path for a packed row: no mask, cu_seqlens from position_ids.
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    bsz, q_len = query.shape[:2]
    position_ids = kwargs["position_ids"]
    (cu_seq_lens_q, cu_seq_lens_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    window = (-1, -1)
    if sliding_window is not None and key.shape[1] > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    out = flash_attn_varlen_func(
        query.reshape(-1, *query.shape[2:]), key.reshape(-1, *key.shape[2:]),
        value.reshape(-1, *value.shape[2:]), cu_seq_lens_q, cu_seq_lens_k, max_q, max_k,
        dropout_p=dropout, softmax_scale=scaling, causal=module.is_causal, window_size=window,
    )
    return out.view(bsz, q_len, *out.shape[1:]), None


ALL_ATTENTION_FUNCTIONS.register("flash_attention_2", flash_attention_forward)


# ---------------------------------------------------------------- axolotl/monkeypatch/gemma4_hybrid_mask.py
_PATCH_APPLIED = False

GLOBAL_PACKED_SDPA = "sdpa_global_packed"


def _packing_block_causal_mask(position_ids, dtype, device):
    """Block-diagonal causal additive mask [B,1,S,S] from packed position_ids (which reset to 0 at
    each document start). -inf across document boundaries and for non-causal positions, 0 elsewhere."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    Bz, Sz = position_ids.shape
    doc = (position_ids == 0).cumsum(-1)  # [B,S] document index (1-based)
    same_doc = doc[:, :, None] == doc[:, None, :]  # [B,S,S]
    causal = torch.ones(Sz, Sz, dtype=torch.bool, device=device).tril()[None]  # [1,S,S]
    allow = same_doc & causal
    mask = torch.zeros(Bz, 1, Sz, Sz, dtype=dtype, device=device)
    mask.masked_fill_(~allow[:, None], torch.finfo(dtype).min)
    return mask


def _register_global_packed_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if GLOBAL_PACKED_SDPA in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return

    def sdpa_global_packed_forward(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is None:
            position_ids = kwargs.get("position_ids")
            if position_ids is not None:
                pid = position_ids if position_ids.dim() > 1 else position_ids[None]
                # >1 doc-start per row => genuine packing; otherwise pure causal is already correct.
                if int((pid == 0).sum()) > pid.shape[0]:
                    attention_mask = _packing_block_causal_mask(pid, query.dtype, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(GLOBAL_PACKED_SDPA, sdpa_global_packed_forward)


_TARGET_MODULES = ("transformers.models.gemma4.modeling_gemma4",)


def _patch_module_create_causal_mask(module) -> bool:
    if not hasattr(module, "create_causal_mask"):
        return False
    original = module.create_causal_mask

    def hybrid_create_causal_mask(config, *args, **kwargs):
        sdpa_config = copy.copy(config)
        sdpa_config._attn_implementation = "sdpa"
        return original(sdpa_config, *args, **kwargs)

    hybrid_create_causal_mask._axolotl_original = original
    module.create_causal_mask = hybrid_create_causal_mask
    return True


def patch_gemma4_hybrid_mask() -> bool:
    global _PATCH_APPLIED
    if _PATCH_APPLIED:
        return True
    if FIXED:
        _register_global_packed_sdpa()
    patched_any = False
    for module_path in _TARGET_MODULES:
        try:
            module = importlib.import_module(module_path)
        except ImportError:
            continue
        if _patch_module_create_causal_mask(module):
            patched_any = True
    if patched_any:
        _PATCH_APPLIED = True
    return patched_any


# ---------------------------------------------------------------- axolotl/loaders/patch_manager.py
class PatchManager:
    def __init__(self, cfg, model_config):
        self.cfg = cfg
        self.model_config = model_config

    def _apply_gemma_hybrid_attention(self, model):
        if not self.cfg["gemma4_hybrid_attn_impl"]:
            return
        patch_gemma4_hybrid_mask()

        layers = None
        config_source = None
        for candidate in [model, getattr(model, "model", None)]:
            if candidate is None:
                continue
            if hasattr(candidate, "layers"):
                layers = candidate.layers
                config_source = candidate
                break
            lang_model = getattr(candidate, "language_model", None)
            if lang_model is not None and hasattr(lang_model, "layers"):
                layers = lang_model.layers
                config_source = lang_model
                break
        if layers is None:
            return

        config = getattr(config_source, "config", self.model_config)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            return

        for layer_idx, layer in enumerate(layers):
            if layer_types[layer_idx] != "sliding_attention":
                attn_module = getattr(layer, "self_attn", None)
                if attn_module is not None and hasattr(attn_module, "config"):
                    sdpa_config = copy.copy(attn_module.config)
                    sdpa_config._attn_implementation = GLOBAL_PACKED_SDPA if FIXED else "sdpa"
                    attn_module.config = sdpa_config


# ---------------------------------------------------------------- model (tiny Gemma 4 text, random weights)
model_config = Gemma4TextConfig(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    per_layer_config={"03": {"head_dim": 32}},  # the global layer's wider head (512 in the real model)
    sliding_window=4,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    pad_token_id=0,
    attn_implementation="sdpa",
)
model = Gemma4ForCausalLM(model_config)
model.config._attn_implementation = "flash_attention_2"  # axolotl loads it with attn_implementation: flash_attention_2
model.eval()

cfg = {"sample_packing": True, "gemma4_hybrid_attn_impl": True, "flash_attention": True}
PatchManager(cfg, model.config)._apply_gemma_hybrid_attention(model)


# ---------------------------------------------------------------- one packed micro-batch, as the multipack collator gives it
def chat_sample(prompt_len, answer_len, g):
    # <bos> <start_of_turn>user ... <end_of_turn> <start_of_turn>model ... <end_of_turn>
    prompt = [2, 105] + torch.randint(10, 150, (prompt_len,), generator=g).tolist() + [106, 105]
    answer = torch.randint(10, 150, (answer_len,), generator=g).tolist() + [106]
    input_ids = prompt + answer
    labels = [-100] * len(prompt) + answer
    return input_ids, labels


g = torch.Generator().manual_seed(1)
samples = [chat_sample(3, 4, g), chat_sample(4, 5, g), chat_sample(2, 6, g)]
input_ids, labels, position_ids, attention_mask = [], [], [], []
for ids, lab in samples:
    input_ids += ids
    labels += lab
    position_ids += list(range(len(ids)))
    attention_mask += [1] * len(ids)

inputs = {
    "input_ids": torch.tensor([input_ids]),
    "labels": torch.tensor([labels]),
    "position_ids": torch.tensor([position_ids]),
    "attention_mask": torch.tensor([attention_mask]),
}

# AxolotlTrainer.compute_loss: gemma4 + sample packing -> the all-ones attention_mask is dropped so the
# model reads the packing from position_ids.
if (
    cfg["sample_packing"]
    and model.config.model_type in ("gemma4", "gemma3", "gemma4_unified")
    and "attention_mask" in inputs
    and "position_ids" in inputs
):
    del inputs["attention_mask"]

with torch.no_grad():
    out = model(**inputs)

print("packed row length:", len(input_ids), "documents:", len(samples))
print("loss: %.6f" % out.loss.item())
print("last-token logits[:6]:", [round(x, 4) for x in out.logits[0, -1, :6].tolist()])
