# Correct program (quiet batch quiet-r97a).
# Citation: THUDM/LongAlign modeling_llama.py @dd5765da5d55e2a25002349deb140c0edf516234 (LlamaAttention.forward,
#   LlamaModel._prepare_decoder_attention_mask / forward, LlamaForCausalLM.forward with pack_loss), sort_and_group.py,
#   dataset.py (LMPackDataset, LMDataset) and main.py (DataCollatorForLMPackDataset, DataCollatorForLMDataset)
#   @21d6e8451ba265b3f66a920d6d66c45ca6f0cf3f.
# LongAlign's "pack" training: sort_and_group.py packs right-padded SFT samples into fixed-length rows and records each
# row's sample boundaries as a list [0, end_1, end_2, ..., max_length] (the pad tail is one more entry). That list is
# handed to the model *as attention_mask* (a 1-D int32 tensor); the collator joins the rows' lists into one cu_seqlens
# over the flattened (b s) tokens. LlamaModel keeps a 1-D attention_mask and drops a 2-D one; LlamaAttention flattens
# q/k/v and calls flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, s, s, causal=True) (an SDPA-per-segment
# stand-in below, since flash-attn is CUDA only). position_ids are left to the model (0..len-1 over the whole row):
# RoPE only sees q/k offsets inside a segment. pack_loss weights every labelled token by 1/(its sample's labelled
# tokens) and the collator divides by the number of samples in the global batch, so the loss is the mean over samples
# of each sample's mean token loss. The "naive" batch path (right-padded rows, no attention_mask) is run too.
# Checked: packed logits at every real token equal each sample run alone; both losses equal hand-written loops.
import math
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import LlamaConfig
from transformers.activations import ACT2FN

torch.manual_seed(0)
np.random.seed(0)

PAD_ID = 0
EOS_ID = 2
NUM_GPUS = 2  # torch.cuda.device_count() in the project; the two ranks are run one after the other here


def rearrange_bhsd_to_bs_hd(x):  # einops: 'b h s d -> (b s) h d'
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def flash_attn_unpadded_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    # plain-torch stand-in for flash_attn_varlen_func: one SDPA call per (cu_seqlens_q[i], cu_seqlens_k[i]) segment,
    # causal aligned to the bottom-right corner as flash-attn 2 does (here every segment is square)
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if qe == qs:
            continue
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        if causal and (qe - qs) != (ke - ks):
            keep = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep)
        else:
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal)
        out[qs:qe] = oi.squeeze(0).transpose(0, 1)
    return out


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class LlamaRotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.max_seq_len_cached = -1

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)  # [seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)  # [seq_len, dim]
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = 10000.0
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                               base=self.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        """attention_mask: [bsz, q_len]"""
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        past_key_value = (key_states, value_states) if use_cache else None

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        # (the project's q_len == 1 / cached decode branch, an eager softmax, is not used in training)
        seqlen_q, batch_size = query_states.shape[2], query_states.shape[0]
        seqlen_k = key_states.shape[2]
        query_states, key_states, value_states = [rearrange_bhsd_to_bs_hd(x) for x in
                                                  [query_states, key_states, value_states]]

        # DO flash_attn_varlen_func
        if attention_mask is None or attention_mask.ndim != 1:
            cu_seqlens_q = torch.arange(0, (batch_size + 1) * seqlen_q, step=seqlen_q, dtype=torch.int32,
                                        device=query_states.device)
        else:
            assert seqlen_q == seqlen_k
            cu_seqlens_q = attention_mask

        if self.training:
            assert seqlen_k == seqlen_q
            is_causal = True
            cu_seqlens_k = cu_seqlens_q
        else:
            is_causal = seqlen_q == seqlen_k
            cu_seqlens_k = torch.arange(0, (batch_size + 1) * seqlen_k, step=seqlen_k, dtype=torch.int32,
                                        device=query_states.device) if not is_causal else cu_seqlens_q
        output = flash_attn_unpadded_func(
            query_states, key_states, value_states, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, causal=is_causal
        )
        output = output.reshape(batch_size, seqlen_q, self.num_heads, self.head_dim)  # '(b s) ... -> b s ...'
        attn_output = self.o_proj(output.reshape(batch_size, seqlen_q, self.num_heads * self.head_dim))

        return attn_output, None, past_key_value


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        # [bsz, seq_len]
        if attention_mask.ndim != 1:
            return None
        return attention_mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None):
        batch_size, seq_length = input_ids.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0

        if position_ids is None:
            device = input_ids.device
            position_ids = torch.arange(
                past_key_values_length, seq_length + past_key_values_length, dtype=torch.long, device=device
            )
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones(
                (batch_size, seq_length_with_past), dtype=torch.bool, device=inputs_embeds.device
            )
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
        )

        hidden_states = inputs_embeds
        for idx, decoder_layer in enumerate(self.layers):
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=None,
                output_attentions=False,
                use_cache=False,
            )
            hidden_states = layer_outputs[0]
        hidden_states = self.norm(hidden_states)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.pack_loss = False
        for m in self.modules():  # _init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(mean=0.0, std=config.initializer_range * 10)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        logits = self.lm_head(hidden_states)
        logits = logits.float()

        loss = None
        if labels is not None:
            # Shift so that tokens < n predict n
            shift_logits = logits[..., :-1, :].contiguous()
            shift_logits = shift_logits.view(-1, self.config.vocab_size)
            if isinstance(labels, tuple) or isinstance(labels, list):
                labels, weights = labels
            shift_labels = labels[..., 1:].contiguous().view(-1).to(shift_logits.device)
            if self.pack_loss:
                shift_weights = weights[..., 1:].contiguous()
                loss_fct = CrossEntropyLoss(ignore_index=-100, reduction='none')
                loss = loss_fct(shift_logits, shift_labels)
                loss = (loss * shift_weights.view(-1)).sum()
            else:
                loss_fct = CrossEntropyLoss(ignore_index=-100)
                loss = loss_fct(shift_logits, shift_labels)
        return loss, logits


# ---- data: pre_tokenize.py's rows (right-padded with PAD_ID to max_length, EOS appended, prompt labels -100) ----
max_length = 24
VOCAB = 50


def make_sample(prompt_len, answer_len):
    ids = torch.randint(3, VOCAB, (prompt_len + answer_len,))
    inputs = torch.cat([ids, torch.tensor([EOS_ID])])
    labels = torch.full_like(inputs, -100)
    labels[prompt_len:] = inputs[prompt_len:]
    inputs = torch.cat([inputs, torch.full((max_length - inputs.shape[0],), PAD_ID, dtype=torch.int64)])
    labels = torch.cat([labels, torch.full((max_length - labels.shape[0],), -100, dtype=torch.int64)])
    return inputs, labels


samples = [make_sample(p, a) for p, a in [(3, 4), (5, 2), (2, 6), (4, 3), (6, 5), (3, 2), (2, 3), (7, 4)]]
input_ids = torch.stack([s[0] for s in samples])
labels = torch.stack([s[1] for s in samples])


def sort_and_group_pack(input_ids, labels):
    # sort_and_group.py, "# pack" part (max_length is the packed row length)
    num, _ = input_ids.shape
    new_inputs, new_labels, new_weights, attention_masks = [], [], [], []
    tmp_input = torch.full((max_length,), PAD_ID, dtype=torch.int64)
    tmp_label = torch.full((max_length,), -100, dtype=torch.int64)
    tmp_weight = torch.full((max_length,), 0., dtype=torch.float32)
    attention_mask = [0]
    curr_idx = 0
    idx = 0
    while idx < num:
        input_id, label = input_ids[idx], labels[idx]
        eos_indice = input_id.argmin().item() - 1
        if eos_indice + 1 >= max_length or eos_indice < 0:  # exceed max length
            idx += 1
            continue
        elif curr_idx + eos_indice + 1 >= max_length:  # full, start new pack
            new_inputs.append(tmp_input)
            new_labels.append(tmp_label)
            new_weights.append(tmp_weight)
            attention_masks.append(attention_mask + [max_length])
            curr_idx = 0
            tmp_input = torch.full((max_length,), PAD_ID, dtype=torch.int64)
            tmp_label = torch.full((max_length,), -100, dtype=torch.int64)
            tmp_weight = torch.full((max_length,), 0., dtype=torch.float32)
            attention_mask = [0]
        else:  # pack in
            tmp_input[curr_idx: curr_idx + eos_indice + 1] = input_id[:eos_indice + 1]
            tmp_label[curr_idx: curr_idx + eos_indice + 1] = label[:eos_indice + 1]
            weight = torch.where(label[:eos_indice + 1] == -100, 0, 1)
            if weight.sum() > 0.5:
                weight = weight / weight.sum()
            tmp_weight[curr_idx: curr_idx + eos_indice + 1] = weight
            curr_idx += (eos_indice + 1)
            attention_mask.append(curr_idx)
            idx += 1
    return torch.stack(new_inputs), torch.stack(new_labels), torch.stack(new_weights), attention_masks


pack_inputs, pack_labels, pack_weights, pack_attention_masks = sort_and_group_pack(input_ids, labels)


class LMPackDataset(torch.utils.data.Dataset):
    def __init__(self, input_ids, labels, weights, attention_masks):
        num_gpus = NUM_GPUS
        l = (input_ids.size(0) // num_gpus) * num_gpus
        input_ids, labels, weights, attention_masks = input_ids[:l, :], labels[:l, :], weights[:l, :], attention_masks[:l]
        self.nums = [weights[i * num_gpus:(i + 1) * num_gpus, :].sum() for i in range(l // num_gpus)]
        self.input_ids, self.labels, self.weights, self.attention_masks = input_ids, labels, weights, attention_masks
        self.num_gpus = num_gpus

    def __getitem__(self, idx):
        # (the project's idx < 32 branch only cuts the first rows to 32768 tokens to save memory)
        return {
            'input_ids': self.input_ids[idx],
            'attention_mask': torch.tensor(self.attention_masks[idx], dtype=torch.int32),
            'labels': (self.labels[idx], self.weights[idx], self.nums[idx // self.num_gpus])
        }

    def __len__(self):
        return self.input_ids.size(0)


class DataCollatorForLMPackDataset(object):
    def __call__(self, instances):
        input_ids, attention_masks = tuple([instance[key].unsqueeze(0) for instance in instances]
                                           for key in ["input_ids", "attention_mask"])
        batch_seq_num = instances[0]["labels"][2]
        labels = ([instance["labels"][0].unsqueeze(0) for instance in instances],
                  [instance["labels"][1].unsqueeze(0) for instance in instances])
        input_ids = torch.cat(input_ids, dim=0)
        labels = (torch.cat(labels[0], dim=0), torch.cat(labels[1], dim=0))
        labels = (labels[0], labels[1] * NUM_GPUS / batch_seq_num)
        max_length = input_ids.shape[1]
        attention_mask = attention_masks[0].squeeze()
        acc_length = max_length
        for new_attention_mask in attention_masks[1:]:
            new_attention_mask = new_attention_mask.squeeze()
            attention_mask = torch.cat([attention_mask, new_attention_mask[1:] + acc_length], dim=0)
            acc_length += max_length
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class DataCollatorForLMDataset(object):
    def __call__(self, instances):
        input_ids, labels = tuple([instance[key].unsqueeze(0) for instance in instances] for key in ("input_ids", "labels"))
        input_ids = torch.cat(input_ids, dim=0)
        labels = torch.cat(labels, dim=0)
        eos_indices = input_ids.argmin(dim=1) - 1
        max_position = eos_indices.max()
        if max_position < 0:
            return dict(input_ids=input_ids, labels=labels)
        return dict(input_ids=input_ids[:, :max_position + 1], labels=labels[:, :max_position + 1])


config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD_ID)
model = LlamaForCausalLM(config)
model.pack_loss = True
model.train()

# the packed rows hold all but the last sample's pack (the project never appends the final partial pack)
dataset = LMPackDataset(pack_inputs, pack_labels, pack_weights, pack_attention_masks)
assert len(dataset) == 2
collator = DataCollatorForLMPackDataset()

# the project's run: one packed row per GPU (per_device_train_batch_size 1); each rank's loss is its weighted sum
# times num_gpus / (samples over all ranks' rows), and DDP averages the ranks' gradients (emulated: mean of losses)
rank_losses = []
for rank in range(NUM_GPUS):
    rank_batch = collator([dataset[rank]])
    rank_loss, _ = model(**rank_batch)
    rank_loss.backward()
    rank_losses.append(rank_loss.detach())
loss = torch.stack(rank_losses).mean()

# the collator's multi-row form: both rows in one batch, their boundary lists joined into one cu_seqlens
batch = collator([dataset[0], dataset[1]])
_, logits = model(**batch)

# ---- reference: every packed sample alone, unpadded, no mask ----
packed_samples = []  # (row, start, end, sample index)
s_idx = 0
for row in range(2):
    bounds = pack_attention_masks[row]
    for j in range(len(bounds) - 2):  # the last segment is the pad tail
        packed_samples.append((row, bounds[j], bounds[j + 1], s_idx))
        s_idx += 1

with torch.no_grad():
    per_sample_losses = []
    for row, st, en, si in packed_samples:
        ids = input_ids[si]
        n = int(ids.argmin()) if (ids == PAD_ID).any() else ids.numel()
        assert n == en - st and torch.equal(ids[:n], batch["input_ids"][row, st:en])
        _, solo_logits = model(input_ids=ids[:n].unsqueeze(0))
        torch.testing.assert_close(logits[row, st:en].detach(), solo_logits[0], rtol=1e-4, atol=1e-4)
        lab = labels[si, :n]
        terms = []
        for t in range(1, n):
            if lab[t] != -100:
                terms.append(-torch.log_softmax(solo_logits[0, t - 1], -1)[lab[t]])
        per_sample_losses.append(torch.stack(terms).mean())
    ref_loss = torch.stack(per_sample_losses).mean()
torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-4, atol=1e-5)

# ---- the "naive" / "sort" path: right-padded rows trimmed to the longest, no attention_mask handed ----
naive = DataCollatorForLMDataset()([{'input_ids': input_ids[i], 'labels': labels[i]} for i in range(4)])
model.pack_loss = False
naive_loss, naive_logits = model(**naive)
with torch.no_grad():
    terms = []
    for i in range(4):
        ids = input_ids[i]
        n = int(ids.argmin())
        _, solo_logits = model(input_ids=ids[:n].unsqueeze(0))
        torch.testing.assert_close(naive_logits[i, :n].detach(), solo_logits[0], rtol=1e-4, atol=1e-4)
        for t in range(1, n):
            if labels[i, t] != -100:
                terms.append(-torch.log_softmax(solo_logits[0, t - 1], -1)[labels[i, t]])
    torch.testing.assert_close(naive_loss.detach(), torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)

print("packed rows", pack_attention_masks[:2], "cu_seqlens", batch["attention_mask"].tolist())
print("pack loss %.5f (ref %.5f), naive loss %.5f" % (loss.item(), ref_loss.item(), naive_loss.item()))
print("ok")
