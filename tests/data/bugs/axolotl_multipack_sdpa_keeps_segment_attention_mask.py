"""axolotl multipack under sdpa/eager: the segment-id attention_mask is kept, so packed documents leak.

Citation: axolotl-ai-cloud/axolotl#3796 ("fix: correct and streamline multipack packing decontamination
across attn backends", merged). I read the PR description, not its diff; the names of the collator and of
the config flag are axolotl's, the trainer hook that drops the mask is my rendering of what it describes.

Bug: the multipack collator (V2BatchSamplerDataCollatorForSeq2Seq) packs several samples into one row and
writes attention_mask as segment ids (1,1,1,2,2,3,...), position_ids restarting at 0 per sample. Modern
transformers casts a 2-D attention_mask to bool in create_causal_mask, so the segment ids become "all
real tokens", and it looks for packed sequences in position_ids only when attention_mask is None. For
flash-attention backends axolotl drops the mask (sample_packing_drop_attention_mask), but sdpa/eager were
excluded from that list, so their mask was never dropped and every document attended the ones packed
before it.

Fix: drop the attention_mask for sdpa/eager too, so the mask is built from position_ids (block-causal).

This program: the collator, a cfg dict as axolotl keeps it, the trainer's input preparation, and a
Llama-style model whose mask builder follows transformers' create_causal_mask (bool padding mask, packed
sequences found from position_ids only without a 2-D mask) and calls F.scaled_dot_product_attention.
"""
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

cfg = {
    "sample_packing": True,
    "attn_implementation": "sdpa",
    "sequence_len": 12,
    "micro_batch_size": 1,
}


def normalize_config(cfg):
    drop_backends = ["flash_attention_2", "flash_attention_3", "flex_attention"]
    if FIXED:
        drop_backends += ["sdpa", "eager"]
    cfg["sample_packing_drop_attention_mask"] = (
        cfg["sample_packing"] and cfg["attn_implementation"] in drop_backends
    )


class V2BatchSamplerDataCollatorForSeq2Seq:
    """Collator for multipack: each feature is a list of samples packed into one row."""

    def __init__(self, pad_token_id=0, pad_to_multiple_of=None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features):
        out_features = [{} for _ in features]
        for i, features_ in enumerate(features):
            for feature in features_[0].keys():
                if feature == "length":
                    continue
                if feature == "attention_mask":
                    arrays = [(j + 1) * np.array(item[feature]) for j, item in enumerate(features_)
                              if feature in item]
                else:
                    arrays = [np.array(item[feature]) for item in features_ if feature in item]
                out_features[i][feature] = np.concatenate(arrays)
        max_len = max(len(f["input_ids"]) for f in out_features)
        if self.pad_to_multiple_of:
            max_len = -(-max_len // self.pad_to_multiple_of) * self.pad_to_multiple_of
        pad_values = {"input_ids": self.pad_token_id, "labels": -100, "attention_mask": 0, "position_ids": 0}
        batch = {}
        for key, pad_value in pad_values.items():
            batch[key] = torch.tensor(np.stack([
                np.pad(f[key], (0, max_len - len(f[key])), constant_values=pad_value) for f in out_features
            ]))
        return batch


def find_packed_sequence_indices(position_ids):
    first_dummy_value = position_ids[:, :1] - 1
    position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
    return (position_diff != 1).cumsum(-1)


def create_causal_mask(input_embeds, attention_mask, position_ids):
    batch_size, seq_len = input_embeds.shape[:2]
    q_idx = torch.arange(seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    mask = (kv_idx <= q_idx)[None].expand(batch_size, -1, -1)
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask.to(dtype=torch.bool)
    packed_sequence_mask = None
    if position_ids is not None and attention_mask is None:
        packed_sequence_mask = find_packed_sequence_indices(position_ids)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, :]
    if packed_sequence_mask is not None:
        mask = mask & (packed_sequence_mask[:, :, None] == packed_sequence_mask[:, None, :])
    return mask[:, None]


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2, max_position_embeddings=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_position_embeddings, hidden_size)
        self.layers = nn.ModuleList(LlamaAttention(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        inputs_embeds = self.embed_tokens(input_ids)
        causal_mask = create_causal_mask(inputs_embeds, attention_mask, position_ids)
        h = inputs_embeds + self.embed_positions(position_ids)
        for layer in self.layers:
            h = h + layer(h, causal_mask)
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return loss


class AxolotlTrainer:
    def __init__(self, model, cfg):
        self.model = model
        self.cfg = cfg

    def _prepare_inputs(self, inputs):
        if self.cfg["sample_packing_drop_attention_mask"]:
            inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        return inputs

    def compute_loss(self, inputs):
        return self.model(**self._prepare_inputs(inputs))


def sample(ids):
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids,
            "position_ids": list(range(len(ids))), "length": len(ids)}


def main():
    torch.manual_seed(0)
    normalize_config(cfg)
    packed = [[sample([5, 9, 14, 3]), sample([7, 21, 30]), sample([11, 4, 8, 2])]]
    batch = V2BatchSamplerDataCollatorForSeq2Seq(pad_to_multiple_of=cfg["sequence_len"])(packed)
    trainer = AxolotlTrainer(LlamaForCausalLM(), cfg)
    with torch.no_grad():
        loss = trainer.compute_loss(batch)
    print("attention_mask", batch["attention_mask"].tolist())
    print("loss %.4f" % loss.item())


if __name__ == "__main__":
    main()
