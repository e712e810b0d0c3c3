"""Model Optimizer hf_ptq.py: the preview generation drops the calibration sample's attention_mask.

Citation: NVIDIA/Model-Optimizer#1673, "Fix garbage generation preview in hf_ptq.py when
pad_token == eos_token" (merged). In examples/llm_ptq/hf_ptq.py, `pre_quantize` takes the first
sample of the left-padded calibration dataloader,
`preview_input_ids = next(iter(calib_dataloader))["input_ids"][0:1]`, and both `pre_quantize` and
`post_quantize` call `full_model.generate(preview_input_ids, max_new_tokens=100)` with no
attention_mask. generate only infers a mask from the pad id when pad_token_id != eos_token_id;
when they are equal (GLM-5.1 in the PR) it falls back to all ones, so the prompt's leading
pad/eos tokens are attended in prefill and in every decode step. The fix threads the calibration
batch's attention_mask through to both preview generate() calls.

This program: the calibration dataloader (input_ids + attention_mask, left padded with the EOS id,
the first sample shorter than the longest), `pre_quantize` / `post_quantize` as the script has
them (argparse args, a per-tensor int8 fake quantization in between), and a small causal LM whose
`generate` follows transformers' rule for inferring the mask and decodes with a KV cache; each
step calls F.scaled_dot_product_attention with the 2-D mask expanded over the cached keys.
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

FIXED = "--fixed" in sys.argv

EOS = 2


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.generation_config = argparse.Namespace(pad_token_id=EOS, eos_token_id=EOS)
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.qkv = nn.ModuleList(nn.Linear(hidden_size, 3 * hidden_size, bias=False) for _ in range(num_layers))
        self.o_proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, past_key_values):
        b, t = input_ids.shape
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        total = past + t
        q_pos = torch.arange(past, total)[:, None]
        k_pos = torch.arange(total)[None, :]
        mask = (k_pos <= q_pos)[None, None] & attention_mask[:, None, None, :total].bool()
        # A left-pad query with no real key before it keeps its own key (finite softmax).
        mask = mask | (k_pos == q_pos)[None, None]
        h = self.embed_tokens(input_ids)
        new_cache = []
        for i, (qkv, o_proj) in enumerate(zip(self.qkv, self.o_proj)):
            q, k, v = qkv(h).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            if past_key_values:
                k = torch.cat([past_key_values[i][0], k], dim=2)
                v = torch.cat([past_key_values[i][1], v], dim=2)
            new_cache.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return self.lm_head(h), new_cache

    def _prepare_attention_mask_for_generation(self, input_ids):
        pad, eos = self.generation_config.pad_token_id, self.generation_config.eos_token_id
        can_infer = pad is not None and (pad in input_ids) and (eos is None or pad != eos)
        if can_infer:
            return input_ids.ne(pad).long()
        return torch.ones_like(input_ids)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=20):
        if attention_mask is None:
            attention_mask = self._prepare_attention_mask_for_generation(input_ids)
        cache, cur, out = None, input_ids, input_ids
        for _ in range(max_new_tokens):
            logits, cache = self(cur, attention_mask, cache)
            cur = logits[:, -1:].argmax(-1)
            out = torch.cat([out, cur], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(cur)], dim=1)
        return out


def make_calib_dataloader(samples, batch_size):
    width = max(len(s) for s in samples)
    input_ids = torch.tensor([[EOS] * (width - len(s)) + s for s in samples])
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in samples])
    data = [{"input_ids": i, "attention_mask": m} for i, m in zip(input_ids, attention_mask)]
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def pre_quantize(args, full_model, calib_dataloader):
    batch = next(iter(calib_dataloader))
    preview_input_ids = batch["input_ids"][0:1]
    preview_attention_mask = batch["attention_mask"][0:1] if FIXED else None
    if args.skip_generate:
        return preview_input_ids, preview_attention_mask, None
    generated_ids_before_ptq = full_model.generate(
        preview_input_ids, attention_mask=preview_attention_mask, max_new_tokens=args.max_new_tokens
    )
    return preview_input_ids, preview_attention_mask, generated_ids_before_ptq


def mono_quantize(full_model):
    with torch.no_grad():
        for m in full_model.modules():
            if isinstance(m, nn.Linear):
                scale = m.weight.abs().max() / 127
                m.weight.copy_((m.weight / scale).round().clamp(-127, 127) * scale)


def post_quantize(args, full_model, preview_input_ids, preview_attention_mask, generated_ids_before_ptq):
    if generated_ids_before_ptq is None:
        return
    generated_ids_after_ptq = full_model.generate(
        preview_input_ids, attention_mask=preview_attention_mask, max_new_tokens=args.max_new_tokens
    )
    n = preview_input_ids.shape[1]
    print("before ptq:", generated_ids_before_ptq[0, n:].tolist())
    print("after ptq: ", generated_ids_after_ptq[0, n:].tolist())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=4)
    parser.add_argument("--skip_generate", action="store_true")
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    full_model = TinyCausalLM().eval()
    samples = [[11, 23, 5], [7, 30, 41, 9, 12, 50, 3, 18], [4, 4, 40, 21, 9], [33, 8]]
    calib_dataloader = make_calib_dataloader(samples, args.batch_size)
    preview_input_ids, preview_attention_mask, before = pre_quantize(args, full_model, calib_dataloader)
    mono_quantize(full_model)
    post_quantize(args, full_model, preview_input_ids, preview_attention_mask, before)


if __name__ == "__main__":
    main()
