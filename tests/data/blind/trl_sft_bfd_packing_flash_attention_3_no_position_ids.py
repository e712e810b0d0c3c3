# Citation: huggingface/trl#3942, commit 4b3517facce4675f3f0318968ebd2bb298afdab2
#   ("Return `position_ids` for `flash_attention_3`"), bug state read at 4b3517fac^.
# Upstream: trl/trainer/sft_trainer.py -- SFTTrainer.__init__ (use_flash_attention list,
#   DataCollatorForLanguageModeling(return_position_ids=use_flash_attention)),
#   DataCollatorForLanguageModeling.torch_call / get_position_ids_from_packed_seq_lengths;
#   trl/data_utils.py _pack_bfd (seq_lengths column). The model side follows transformers'
#   flash path (masking_utils.flash_attention_mask drops an all-ones mask;
#   modeling_flash_attention_utils._flash_attention_forward picks varlen from position_ids).
# Bug: SFTTrainer only treated "flash_attention_2" and "kernels-community/vllm-flash-attn3" as
#   flash attention. With attn_implementation="flash_attention_3" and BFD packing
#   (padding-free), the collator was built with return_position_ids=False, so a packed row came
#   with an all-ones attention_mask and no position_ids: the flash path then runs one causal
#   attention over the whole row (documents see each other, positions keep counting).
# Fix: add "flash_attention_3" to the list, so the collator returns per-document position_ids
#   (and no attention_mask), and the flash path splits the row by cu_seqlens.
import sys
import math
from collections import defaultdict, deque

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------
# trl/data_utils.py: _pack_bfd (pyarrow replaced by python lists; same Best Fit Decreasing logic)
# ----------------------------------------------------------------------------------------------
class _SegmentTree:
    def __init__(self, maxval):
        self.maxval = maxval
        self.tree = [0] * (2 * maxval)

    def add(self, val):
        i = val + self.maxval - 1
        self.tree[i] = val
        while i > 1:
            i >>= 1
            left, right = self.tree[i << 1], self.tree[(i << 1) + 1]
            self.tree[i] = left if left >= right else right

    def remove(self, val):
        i = val + self.maxval - 1
        self.tree[i] = 0
        while i > 1:
            i >>= 1
            left, right = self.tree[i << 1], self.tree[(i << 1) + 1]
            self.tree[i] = left if left >= right else right

    def search(self, val):
        i = 1
        while i < self.maxval:
            if self.tree[i << 1] >= val:
                i = i << 1
            else:
                i = (i << 1) + 1
        return self.tree[i]


def _pack_bfd(examples, seq_length):
    input_ids = [ids[:seq_length] for ids in examples["input_ids"]]
    lengths = [len(ids) for ids in input_ids]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])

    segment_tree = _SegmentTree(seq_length)
    segment_tree.add(seq_length)
    space_to_bin = defaultdict(deque)
    bins = []
    for idx in order:
        length = lengths[idx]
        space = segment_tree.search(length)
        if space < seq_length:
            bin = space_to_bin[space].popleft()
        else:
            bin = {"ids": [], "length": 0}
            bins.append(bin)
        bin["ids"].append(idx)
        bin["length"] += length
        if space < seq_length and not space_to_bin[space]:
            segment_tree.remove(space)
        space = space - length
        space_to_bin[space].append(bin)
        if space > 0:
            segment_tree.add(space)

    packed = {"input_ids": [], "seq_lengths": []}
    for bin in bins:
        packed["input_ids"].append([t for i in bin["ids"] for t in input_ids[i]])
        packed["seq_lengths"].append([lengths[i] for i in bin["ids"]])
    return packed


# ----------------------------------------------------------------------------------------------
# trl/trainer/sft_trainer.py: DataCollatorForLanguageModeling
# ----------------------------------------------------------------------------------------------
def pad(tensors, padding_value=0, padding_side="right", pad_to_multiple_of=None):
    max_len = max(t.shape[0] for t in tensors)
    if pad_to_multiple_of is not None and max_len % pad_to_multiple_of:
        max_len += pad_to_multiple_of - max_len % pad_to_multiple_of
    out = torch.full((len(tensors), max_len), padding_value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        if padding_side == "left":
            out[i, max_len - t.shape[0]:] = t
        else:
            out[i, : t.shape[0]] = t
    return out


class DataCollatorForLanguageModeling:
    def __init__(self, pad_token_id, completion_only_loss=True, padding_free=False,
                 return_position_ids=True, pad_to_multiple_of=None, return_tensors="pt"):
        self.pad_token_id = pad_token_id
        self.completion_only_loss = completion_only_loss
        self.padding_free = padding_free
        self.return_position_ids = return_position_ids
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_tensors = return_tensors

    def __call__(self, examples):
        return self.torch_call(examples)

    def torch_call(self, examples):
        input_ids = [torch.tensor(example["input_ids"]) for example in examples]

        # Check if we have meaningful seq_lengths from packing (restarting sequences)
        has_packed_position_ids = self.return_position_ids and "seq_lengths" in examples[0] and self.padding_free

        # For packing with position_ids, we should NOT create attention_mask as it causes
        # FlashAttention to ignore position_ids and compute wrong cu_seq_lens from the all-1s mask
        if not has_packed_position_ids:
            attention_mask = [torch.ones_like(ids) for ids in input_ids]

        if self.return_position_ids:
            if "seq_lengths" in examples[0]:
                position_ids = self.get_position_ids_from_packed_seq_lengths(
                    [example["seq_lengths"] for example in examples]
                )
            else:
                position_ids = [torch.arange(len(ids)) for ids in input_ids]
        if "labels" in examples[0]:
            labels = [torch.tensor(example["labels"]) for example in examples]
        else:
            labels = [torch.tensor(example["input_ids"]) for example in examples]

        output = {}
        if self.padding_free:
            output["input_ids"] = torch.cat(input_ids, dim=0).unsqueeze(0)
            if not has_packed_position_ids:
                output["attention_mask"] = torch.cat(attention_mask, dim=0).unsqueeze(0)
            if self.return_position_ids:
                output["position_ids"] = torch.cat(position_ids, dim=0).unsqueeze(0)
            output["labels"] = torch.cat(labels, dim=0).unsqueeze(0)
        else:
            output["input_ids"] = pad(input_ids, padding_value=self.pad_token_id, padding_side="right",
                                      pad_to_multiple_of=self.pad_to_multiple_of)
            output["attention_mask"] = pad(attention_mask, padding_value=0, padding_side="right",
                                           pad_to_multiple_of=self.pad_to_multiple_of)
            if self.return_position_ids:
                output["position_ids"] = pad(position_ids, padding_value=0, padding_side="right",
                                             pad_to_multiple_of=self.pad_to_multiple_of)
            output["labels"] = pad(labels, padding_value=-100, padding_side="right",
                                   pad_to_multiple_of=self.pad_to_multiple_of)
        return output

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths):
        example_lengths = [sum(seq_lengths) for seq_lengths in batch_seq_lengths]
        batch_seq_lengths = torch.tensor(
            [seq_length for seq_lengths in batch_seq_lengths for seq_length in seq_lengths]
        )
        position_ids = torch.ones(sum(example_lengths), dtype=batch_seq_lengths.dtype)
        position_ids[0] = 0
        position_ids[batch_seq_lengths[:-1].cumsum(0)] = -(batch_seq_lengths[:-1] - 1)
        position_ids = position_ids.cumsum(0)
        return list(position_ids.split(example_lengths))


# ----------------------------------------------------------------------------------------------
# flash_attn_interface stand-ins (same signatures / semantics, plain torch)
# ----------------------------------------------------------------------------------------------
def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    # q, k, v: [batch, seqlen, nheads, headdim]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale
    )
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False):
    # q, k, v: [total_tokens, nheads, headdim]
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            is_causal=causal, scale=softmax_scale,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


# ----------------------------------------------------------------------------------------------
# transformers: masking_utils.flash_attention_mask, modeling_flash_attention_utils
# ----------------------------------------------------------------------------------------------
def flash_attention_mask(attention_mask, kv_length):
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        # only return an actual mask if there is at least 1 padding token
        if attention_mask.all():
            attention_mask = None
    return attention_mask


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def _is_packed_sequence(position_ids, batch_size):
    if position_ids is None:
        return False
    increasing_position_sequences = torch.arange(position_ids.shape[1]) + position_ids.min()
    return batch_size == 1 and bool((increasing_position_sequences - position_ids).abs().sum())


def prepare_fa_kwargs_from_position_ids(position_ids):
    position_ids = position_ids.view(-1)
    indices_q = (position_ids == 0).nonzero().view(-1)
    cu_seq_lens = torch.cat((indices_q.to(torch.int32), torch.tensor([position_ids.size(0)], dtype=torch.int32)))
    max_length = int(cu_seq_lens.diff().max())
    return (cu_seq_lens, cu_seq_lens), (max_length, max_length)


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length,
                             is_causal, position_ids=None, softmax_scale=None):
    bsz = query_states.size(0)
    if attention_mask is not None:
        indices, cu_seqlens, max_seqlen = _get_unpad_data(attention_mask)
        q = query_states.reshape(-1, *query_states.shape[2:])[indices]
        k = key_states.reshape(-1, *key_states.shape[2:])[indices]
        v = value_states.reshape(-1, *value_states.shape[2:])[indices]
        out_unpad = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                           softmax_scale=softmax_scale, causal=is_causal)
        out = torch.zeros(bsz * query_length, *out_unpad.shape[1:], dtype=out_unpad.dtype)
        out[indices] = out_unpad
        return out.view(bsz, query_length, *out_unpad.shape[1:])
    elif _is_packed_sequence(position_ids, bsz):
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
        q = query_states.reshape(-1, *query_states.shape[2:])
        k = key_states.reshape(-1, *key_states.shape[2:])
        v = value_states.reshape(-1, *value_states.shape[2:])
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                                     causal=is_causal)
        return out.view(bsz, -1, *out.shape[1:])
    else:
        return flash_attn_func(query_states, key_states, value_states, softmax_scale=softmax_scale,
                               causal=is_causal)


# ----------------------------------------------------------------------------------------------
# tiny Llama-style causal LM (RoPE from position_ids, flash attention path)
# ----------------------------------------------------------------------------------------------
class Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    intermediate_size = 64
    rope_theta = 10000.0
    _attn_implementation = "flash_attention_3"


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, cos, sin, attention_mask, position_ids):
        b, l, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, l, self.n_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, l, self.n_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, l, self.n_heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = _flash_attention_forward(q, k, v, attention_mask, l, is_causal=True, position_ids=position_ids,
                                       softmax_scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.reshape(b, l, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, h, cos, sin, attention_mask, position_ids):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attention_mask, position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class TinyLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        seq_len = input_ids.shape[1]
        cache_position = torch.arange(seq_len)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        mask = flash_attention_mask(attention_mask, kv_length=seq_len)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, position_ids)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].reshape(-1, logits.size(-1))
            shift_labels = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return {"loss": loss, "logits": logits}


# ----------------------------------------------------------------------------------------------
# SFTTrainer.__init__ (collator selection) + one training-step forward
# ----------------------------------------------------------------------------------------------
class SFTConfig:
    packing = True
    packing_strategy = "bfd"
    padding_free = False
    max_length = 24
    completion_only_loss = None
    pad_to_multiple_of = None


def build_collator(model, args, pad_token_id):
    padding_free = args.padding_free or (args.packing and args.packing_strategy == "bfd")
    if FIXED:
        flash_impls = ["flash_attention_2", "flash_attention_3", "kernels-community/vllm-flash-attn3"]
    else:
        flash_impls = ["flash_attention_2", "kernels-community/vllm-flash-attn3"]
    use_flash_attention = model.config._attn_implementation in flash_impls
    return DataCollatorForLanguageModeling(
        pad_token_id=pad_token_id,
        completion_only_loss=False,
        padding_free=padding_free,
        # Using position_ids without flash_attn hurts the training
        return_position_ids=use_flash_attention,
        pad_to_multiple_of=args.pad_to_multiple_of,
    )


def main():
    config = Config()
    model = TinyLlamaForCausalLM(config).eval()
    args = SFTConfig()

    # Tokenized language-modeling dataset (documents of different lengths), then BFD packing.
    g = torch.Generator().manual_seed(1)
    doc_lengths = [9, 6, 11, 5, 7, 4, 8, 3]
    dataset = {"input_ids": [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in doc_lengths]}
    packed = _pack_bfd(dataset, seq_length=args.max_length)
    rows = [{"input_ids": ids, "seq_lengths": sl} for ids, sl in zip(packed["input_ids"], packed["seq_lengths"])]
    print("packed rows seq_lengths:", [r["seq_lengths"] for r in rows])

    collator = build_collator(model, args, pad_token_id=0)
    with torch.no_grad():
        total = 0.0
        for step, row in enumerate(rows):
            batch = collator([row])
            print(f"step {step}: keys={sorted(batch.keys())}")
            out = model(**batch)
            total += out["loss"].item()
            # per-document loss inside the packed row
            logits, ids = out["logits"][0], batch["input_ids"][0]
            off, doc_losses = 0, []
            for n in row["seq_lengths"]:
                lp = F.cross_entropy(logits[off: off + n - 1], ids[off + 1: off + n])
                doc_losses.append(round(lp.item(), 4))
                off += n
            print(f"  loss={out['loss'].item():.4f} per-document={doc_losses}")
        print(f"mean loss over packed rows: {total / len(rows):.4f}")


if __name__ == "__main__":
    main()
