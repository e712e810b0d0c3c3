# Citation: imoneoi/openchat @47a3596168ed90d8f948f63f458948c3db98e2b8 (files last changed in a350a6a):
#   ochat/config/conversation_template.py (ConversationTemplate.tokenize_conversations: role prefix weight 0,
#   message and <|end_of_turn|> weighted by the message's weight), ochat/config/__init__.py ("openchat_v3.2"
#   template: _v3_2_role_prefix, eot "<|end_of_turn|>"), ochat/data/generate_dataset.py
#   (truncate_trailing_zero_weighted, add_single_conv: nz_position_ids = range(length), shifted labels / weights),
#   ochat/training_deepspeed/openchat_dataset.py (OpenchatDataset._load_batch: concatenate the conversations the
#   multipack sampler picked, one unused item of length pad_len fills the batch to PAD_MULTIPLE, cu_seqlens from
#   seqlens), ochat/models/unpadded_llama.py (UnpaddedLlamaAttention: RoPE gathered at nz_position_ids,
#   flash_attn_varlen_func(cu_seqlens, causal=True); lm_head_with_loss), ochat/training_deepspeed/train.py
#   (loss scaled by WORLD_SIZE / all_numseq).
# Multi-turn chat SFT, packed and unpadded: several conversations sit end to end in one flat token stream, each with
# positions 0..n-1 and its own cu_seqlens segment; only assistant messages (and their end-of-turn token) carry loss
# weight. flash-attn is not on CPU: flash_attn_varlen_func below runs the kernel's semantics (causal attention inside
# each cu_seqlens segment) one segment at a time with SDPA. The multipack sampler's choice of conversations per batch
# is replaced by fixed index groups; the tokenizer is a character-level stand-in with the template's special tokens.
# Self-check: every conversation run alone through transformers' LlamaForCausalLM (same weights, no mask, positions
# 0..n-1): final hidden states per token, the weighted loss and token accuracy summed by a double loop.
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM as HFLlamaForCausalLM
from transformers.activations import ACT2FN

torch.manual_seed(0)
PAD_TOKEN_ID = 0


# ---- tokenizer stand-in (sentencepiece in the project) ----
class CharTokenizer:
    is_fast = False
    SPECIAL = ["<unk>", "<s>", "</s>", "<|end_of_turn|>"]

    def __init__(self):
        chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!'-\n"))
        self.vocab = {t: i for i, t in enumerate(self.SPECIAL + chars)}
        self.bos_token_id = 1

    def _encode(self, s, split_special_tokens):
        ids = []
        i = 0
        while i < len(s):
            if not split_special_tokens:
                hit = next((t for t in self.SPECIAL if s.startswith(t, i)), None)
                if hit is not None:
                    ids.append(self.vocab[hit])
                    i += len(hit)
                    continue
            ids.append(self.vocab.get(s[i], 0))
            i += 1
        return ids

    class _Out:
        def __init__(self, input_ids):
            self.input_ids = input_ids

    def __call__(self, strings, split_special_tokens=False, return_attention_mask=False, add_special_tokens=True):
        single = isinstance(strings, str)
        batch = [strings] if single else list(strings)
        out = [([self.bos_token_id] if add_special_tokens else []) + self._encode(s, split_special_tokens) for s in batch]
        return self._Out(out[0] if single else out)


# ---- ochat/config/conversation_template.py ----
class Message:
    def __init__(self, role, content, weight=None):
        self.role, self.content, self.weight = role, content, weight


class Conversation:
    def __init__(self, items, condition="", system=""):
        self.items, self.condition, self.system = items, condition, system


class ConversationTemplate:
    def __init__(self, tokenizer, role_prefix, eot, system_as_role=False, inference_condition=None):
        self.tokenizer = tokenizer
        self.role_prefix = role_prefix
        self.eot = eot
        self.system_as_role = system_as_role
        self.inference_condition = inference_condition
        self.bos_tokens_ = tokenizer("").input_ids
        self.eot_tokens_ = tokenizer(eot, add_special_tokens=False).input_ids

    def _tokenize(self, strings, ignore_special=True):
        return self.tokenizer(strings, split_special_tokens=ignore_special, return_attention_mask=False, add_special_tokens=False).input_ids

    def tokenize_conversations(self, conversations, inference=False, seq_level_weight=False):
        default_condition = self.inference_condition if inference else ""

        sys_mappings = set()
        role_mappings = set()
        all_text = []
        for conv in conversations:
            sys_mappings.add(conv.system)
            for msg in conv.items:
                role_mappings.add((msg.role, conv.condition or default_condition))
                all_text.append(msg.content)

        system_role_tokens = []
        if self.system_as_role:
            system_role_tokens = self._tokenize(self.role_prefix("system", ""), ignore_special=False)

        sys_mappings = list(sys_mappings)
        role_mappings = list(role_mappings)

        sys_mappings = dict(zip(sys_mappings, self._tokenize(sys_mappings)))
        role_mappings = dict(zip(role_mappings, self._tokenize([self.role_prefix(*args) for args in role_mappings], ignore_special=False)))
        all_text = self._tokenize(all_text)

        result_tokens = []
        result_weights = []
        all_text_idx = 0
        for conv in conversations:
            tokens = []
            weights = []

            tokens.extend(self.bos_tokens_)
            weights.extend([0.] * len(self.bos_tokens_))

            if conv.system:
                tokens.extend(system_role_tokens)
                weights.extend([0.] * len(system_role_tokens))

                system = sys_mappings[conv.system]
                tokens.extend(system)
                weights.extend([0.] * len(system))

                tokens.extend(self.eot_tokens_)
                weights.extend([0.] * len(self.eot_tokens_))

            last_idx = len(conv.items) - 1
            for idx, msg in enumerate(conv.items):
                role = role_mappings[(msg.role, conv.condition or default_condition)]
                tokens.extend(role)
                weights.extend([0.] * len(role))

                text = all_text[all_text_idx]
                all_text_idx += 1

                w = None
                if not inference:
                    assert msg.weight is not None

                    w = msg.weight
                    if seq_level_weight:
                        w /= len(text) + len(self.eot_tokens_)

                tokens.extend(text)
                weights.extend([w] * len(text))

                if not (inference and idx == last_idx):
                    tokens.extend(self.eot_tokens_)
                    weights.extend([w] * len(self.eot_tokens_))

            result_tokens.append(tokens)
            result_weights.append(weights)

        assert all_text_idx == len(all_text)
        return result_tokens, result_weights


def _v3_2_role_prefix(from_role, condition):
    return f"{condition} {from_role.title()}:".strip()


# ---- ochat/data/generate_dataset.py ----
def truncate_trailing_zero_weighted(tokens, weights):
    non_zero_index = len(weights) - 1
    while non_zero_index >= 0 and weights[non_zero_index] == 0:
        non_zero_index -= 1

    return tokens[:non_zero_index + 1], weights[:non_zero_index + 1]


def add_single_conv(output, tokens, weights):
    tokens, weights = truncate_trailing_zero_weighted(tokens, weights)
    if not tokens:
        return

    length = len(tokens)
    labels = [(t if w != 0 else PAD_TOKEN_ID) for t, w in zip(tokens, weights)]

    results = {
        "total_length": length,

        "seqlens": [length],
        "nz_input_ids": tokens,
        "nz_position_ids": list(range(length)),

        "nz_shifted_label_ids":    labels[1:]  + [PAD_TOKEN_ID],
        "nz_shifted_loss_weights": weights[1:] + [0.0]
    }
    results["num_seqs"] = sum(results["nz_shifted_loss_weights"])

    for k, v in results.items():
        output[k].append(v)


# ---- ochat/training_deepspeed/openchat_dataset.py ----
def _find_multiple(a, b):
    return (-(a // -b)) * b


class OpenchatDataset:
    def __init__(self, dataset, batch_max_length):
        self.PAD_ID = 0
        self.PAD_MULTIPLE = 16  # 64 in the project; smaller here so the tiny batches get a filler item
        self.BATCH_KEYS = {
            "seqlens": torch.int32,
            "nz_input_ids": torch.long,
            "nz_position_ids": torch.long,
            "nz_shifted_label_ids": torch.long,

            "nz_shifted_loss_weights": torch.float32  # bfloat16 in the project
        }
        assert batch_max_length % self.PAD_MULTIPLE == 0
        self.dataset = {k: np.array([np.array(x) for x in v] if isinstance(v[0], list) else v, dtype=object if isinstance(v[0], list) else None)
                        for k, v in dataset.items()}

    def _load_batch(self, indices):
        batch = {k: v[indices] for k, v in self.dataset.items()}

        batch = {k: np.concatenate(batch[k], axis=0) for k in self.BATCH_KEYS.keys()}

        total_seqlen = batch["nz_input_ids"].size
        pad_len      = _find_multiple(total_seqlen, self.PAD_MULTIPLE) - total_seqlen

        if pad_len > 0:
            assert pad_len < self.PAD_MULTIPLE

            padding_specs = {
                "seqlens": (1, pad_len),

                "nz_input_ids": (pad_len, self.PAD_ID),
                "nz_position_ids": (pad_len, 0),
                "nz_shifted_label_ids": (pad_len, self.PAD_ID),
                "nz_shifted_loss_weights": (pad_len, 0),
            }
            for k, pad_spec in padding_specs.items():
                batch[k] = np.concatenate((batch[k], np.full(*pad_spec, dtype=batch[k].dtype)), axis=0)

        batch_tensor = {}
        for k, dtype in self.BATCH_KEYS.items():
            batch_tensor[k] = torch.from_numpy(batch[k].astype(np.float64 if dtype.is_floating_point else np.int64)).to(dtype)

        batch_tensor["cu_seqlens"] = torch.nn.functional.pad(batch_tensor["seqlens"].cumsum(-1, dtype=torch.int32), (1, 0))
        batch_info = {"max_seqlen": torch.max(batch_tensor["seqlens"]).item()}

        del batch_tensor["seqlens"]
        return batch_tensor, batch_info


# ---- flash_attn.flash_attn_varlen_func, CPU stand-in with the kernel's semantics ----
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, causal=False):
    out = torch.empty_like(q)
    n_rep = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout_p, is_causal=causal).transpose(0, 1)
    return out


# ---- ochat/models/unpadded_llama.py ----
def lm_head_with_loss(embed_weights, hidden_states, nz_shifted_label_ids, nz_shifted_loss_weights):
    logits = F.linear(hidden_states, embed_weights)

    loss = (nz_shifted_loss_weights * torch.nn.functional.cross_entropy(logits, nz_shifted_label_ids, reduction="none")).sum()
    token_accuracy = (nz_shifted_loss_weights * (torch.argmax(logits.detach(), dim=-1) == nz_shifted_label_ids)).sum()
    return loss, token_accuracy


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(-2)
    sin = sin[position_ids].unsqueeze(-2)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class UnpaddedLlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = (hidden_states * hidden_states).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class UnpaddedLlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self):
        return self.cos_cached, self.sin_cached


class UnpaddedLlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnpaddedLlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, cos_sin, nz_hidden_states, nz_position_ids, cu_seqlens, max_seqlen):
        query_states = self.q_proj(nz_hidden_states).view(-1, self.num_heads, self.head_dim)
        key_states = self.k_proj(nz_hidden_states).view(-1,   self.num_key_value_heads, self.head_dim)
        value_states = self.v_proj(nz_hidden_states).view(-1, self.num_key_value_heads, self.head_dim)

        cos, sin = cos_sin
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, nz_position_ids)

        attn_output = flash_attn_varlen_func(
            q=query_states, k=key_states, v=value_states,
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
            dropout_p=0.0, causal=True)

        attn_output = attn_output.view(-1, self.hidden_size)
        return self.o_proj(attn_output)


class UnpaddedLlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = UnpaddedLlamaAttention(config=config)
        self.mlp = UnpaddedLlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = UnpaddedLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = UnpaddedLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, cos_sin, nz_hidden_states, nz_position_ids, cu_seqlens, max_seqlen):
        residual = nz_hidden_states
        nz_hidden_states = self.input_layernorm(nz_hidden_states)
        nz_hidden_states = self.self_attn(cos_sin=cos_sin, nz_hidden_states=nz_hidden_states,
                                          nz_position_ids=nz_position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        nz_hidden_states = residual + nz_hidden_states

        residual = nz_hidden_states
        nz_hidden_states = self.post_attention_layernorm(nz_hidden_states)
        nz_hidden_states = self.mlp(nz_hidden_states)
        nz_hidden_states = residual + nz_hidden_states
        return nz_hidden_states


class UnpaddedLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.rotary_emb = UnpaddedLlamaRotaryEmbedding(config.hidden_size // config.num_attention_heads,
                                                       max_position_embeddings=config.max_position_embeddings,
                                                       base=config.rope_parameters["rope_theta"])  # config.rope_theta in transformers 4
        self.layers = nn.ModuleList([UnpaddedLlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = UnpaddedLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, nz_input_ids, nz_position_ids, cu_seqlens, max_seqlen):
        nz_hidden_states = self.embed_tokens(nz_input_ids)
        cos_sin = self.rotary_emb()
        for decoder_layer in self.layers:
            nz_hidden_states = decoder_layer(cos_sin, nz_hidden_states, nz_position_ids, cu_seqlens, max_seqlen)
        nz_hidden_states = self.norm(nz_hidden_states)
        return nz_hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = UnpaddedLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, nz_input_ids, nz_position_ids, cu_seqlens, max_seqlen, nz_shifted_label_ids=None, nz_shifted_loss_weights=None):
        hidden_states = self.model(nz_input_ids=nz_input_ids, nz_position_ids=nz_position_ids,
                                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        loss = lm_head_with_loss(self.lm_head.weight, hidden_states, nz_shifted_label_ids, nz_shifted_loss_weights)
        return loss, hidden_states


# ---- data: ShareGPT-style conversations, user weight 0, assistant weight 1 ----
def conv(system, *turns):
    items = [Message(role, content, weight=(1.0 if role == "assistant" else 0.0)) for role, content in turns]
    return Conversation(items=items, condition="GPT4 Correct", system=system)


conversations = [
    conv("", ("user", "hi there"), ("assistant", "Hello! How can I help?")),
    conv("Be brief.", ("user", "2+2?"), ("assistant", "4."), ("user", "and 3+3?"), ("assistant", "6, of course.")),
    conv("", ("user", "name a fruit"), ("assistant", "apple"), ("user", "another one please")),  # trailing user turn is cut
    conv("You are a poet.", ("user", "a line on rain"), ("assistant", "Soft rain on the roof, a quiet drum.")),
    conv("", ("user", "translate: chat"), ("assistant", "cat"), ("user", "and chien?"), ("assistant", "dog"),
         ("user", "oiseau?"), ("assistant", "bird!")),
]

tokenizer = CharTokenizer()
conv_template = ConversationTemplate(tokenizer=tokenizer, role_prefix=_v3_2_role_prefix, eot="<|end_of_turn|>",
                                     inference_condition="GPT4 Correct")
tokens_list, weights_list = conv_template.tokenize_conversations(conversations, inference=False, seq_level_weight=False)

max_context = 4096
names = ["total_length", "num_seqs", "seqlens", "nz_input_ids", "nz_position_ids", "nz_shifted_label_ids", "nz_shifted_loss_weights"]
outputs = {k: [] for k in names}
for tokens, weights in zip(tokens_list, weights_list):
    assert len(tokens) == len(weights)
    tokens = tokens[:max_context]
    weights = weights[:max_context]
    add_single_conv(outputs, tokens, weights)

config = LlamaConfig(vocab_size=len(tokenizer.vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=False)
model = LlamaForCausalLM(config).eval()
for p in model.parameters():
    nn.init.normal_(p, std=0.2) if p.dim() > 1 else nn.init.uniform_(p, 0.8, 1.2)

train_dataset = OpenchatDataset(outputs, batch_max_length=256)
batches = [[0, 2, 3], [1, 4]]  # what MultipackDistributedSampler.iter would hand out
WORLD_SIZE = 1

# reference: transformers' Llama, same weights, each conversation alone
ref = HFLlamaForCausalLM(config).eval()
missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

with torch.no_grad():
    for indices in batches:
        (batch_tensor, batch_info) = train_dataset._load_batch(np.array(indices))
        all_numseq = float(sum(outputs["num_seqs"][i] for i in indices))
        (loss, acc), hidden = model(**batch_tensor, **batch_info)
        loss = (WORLD_SIZE / all_numseq) * loss
        acc = (WORLD_SIZE / all_numseq) * acc

        ref_loss, ref_acc, offset = 0.0, 0.0, 0
        for i in indices:
            ids = torch.tensor(outputs["nz_input_ids"][i])
            w = outputs["nz_shifted_loss_weights"][i]
            out = ref(input_ids=ids[None], output_hidden_states=True)
            n = ids.numel()
            torch.testing.assert_close(hidden[offset:offset + n], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
            logits = out.logits[0]
            for t in range(n - 1):
                if w[t] != 0:
                    lp = torch.log_softmax(logits[t], -1)
                    ref_loss += w[t] * -lp[ids[t + 1]].item()
                    ref_acc += w[t] * float(logits[t].argmax().item() == ids[t + 1].item())
            offset += n
        assert abs(loss.item() - ref_loss / all_numseq) < 1e-4, (loss.item(), ref_loss / all_numseq)
        assert abs(acc.item() - ref_acc / all_numseq) < 1e-6, (acc.item(), ref_acc / all_numseq)
        print(f"batch {indices}: {batch_tensor['nz_input_ids'].numel()} tokens, cu_seqlens "
              f"{batch_tensor['cu_seqlens'].tolist()}, loss {loss.item():.4f} (reference {ref_loss / all_numseq:.4f})")
print("ok")
