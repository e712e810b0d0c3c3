# Citation: RVC-Boss/GPT-SoVITS#1477 ("[fast_inference] 优化batch inference的mask策略", merge commit
#   f5a5f1890f19a3d0d0bb3917a648f46893500847; branch commit 6b06304e094da56f0597e95cfd23390f0a697d30,
#   parent = the code before the fix).
# Upstream: GPT_SoVITS/AR/models/t2s_model.py, Text2SemanticDecoder.infer_panel_batch_infer(_with_flash_attn)
#   (builds xy_attn_mask / xy_padding_mask), T2SBlock.process_prompt / T2SBlock.decode_next_token,
#   T2STransformer.decode_next_token; AR/models/utils.py make_pad_mask / sample;
#   AR/modules/embedding.py SinePositionalEmbedding.
# Bug: batched T2S inference right-pads every phoneme sequence to max_len, so the padded text slots sit
#   between the real text and the reference-audio prompt. The prefill masks them, but after step 0 the loop set
#   `xy_attn_mask = None` and `decode_next_token` called F.scaled_dot_product_attention(q, k, v) with no mask,
#   so every decoded semantic token of a shorter sentence attends the padded (zeroed) text keys in the KV cache.
# Fix: decode_next_token takes an attn_mask; after the prefill the loop keeps the last row of the prefill mask
#   (`F.pad(xy_attn_mask[:, :, -1].unsqueeze(-2), (0, 1), value=False)`), grows it by one unmasked column each
#   step, index_selects it with the batch when rows finish, and passes it to every decode step. (The same
#   change also masks the padded query rows of the prefill and uses a boolean mask with the repo's own
#   scaled_dot_product_attention, both ported here.)
# Shrunk to tiny sizes, random weights; @torch.jit.script decorators and tqdm dropped.
import math
import sys
from typing import List, Optional

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- AR/models/utils.py
def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    assert lengths.ndim == 1, lengths.ndim
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).expand(n, max_len)
    return expaned_lengths >= lengths.unsqueeze(-1)


def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, previous_tokens=None, temperature=1.0, top_k=None, top_p=None,
                    repetition_penalty=1.0):
    if previous_tokens is not None and repetition_penalty != 1.0:
        previous_tokens = previous_tokens.long()
        score = torch.gather(logits, dim=1, index=previous_tokens)
        score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
        logits.scatter_(dim=1, index=previous_tokens, src=score)

    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cum_probs = torch.cumsum(torch.nn.functional.softmax(sorted_logits, dim=-1), dim=-1)
        sorted_indices_to_remove = cum_probs > top_p
        sorted_indices_to_remove[:, 0] = False
        indices_to_remove = sorted_indices_to_remove.scatter(dim=1, index=sorted_indices,
                                                             src=sorted_indices_to_remove)
        logits = logits.masked_fill(indices_to_remove, -float("Inf"))

    logits = logits / max(temperature, 1e-5)

    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v[:, -1].unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)

    probs = torch.nn.functional.softmax(logits, dim=-1)
    return probs


def sample(logits, previous_tokens=None, **sampling_kwargs):
    probs = logits_to_probs(logits=logits, previous_tokens=previous_tokens, **sampling_kwargs)
    idx_next = multinomial_sample_one_no_sync(probs)
    return idx_next, probs


# ---------------------------------------------------------------- AR/modules/embedding.py
class TokenEmbedding(nn.Module):
    def __init__(self, embedding_dim, vocab_size, dropout=0.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.dropout = torch.nn.Dropout(p=dropout)
        self.word_embeddings = nn.Embedding(self.vocab_size, self.embedding_dim)

    def forward(self, x):
        x = self.word_embeddings(x)
        x = self.dropout(x)
        return x


class SinePositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, dropout=0.0, scale=False, alpha=False):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.x_scale = math.sqrt(embedding_dim) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)
        self.dropout = torch.nn.Dropout(p=dropout)
        self.reverse = False
        self.pe = None
        self.extend_pe(torch.tensor(0.0).expand(1, 4000))

    def extend_pe(self, x):
        if self.pe is not None:
            if self.pe.size(1) >= x.size(1):
                if self.pe.dtype != x.dtype or self.pe.device != x.device:
                    self.pe = self.pe.to(dtype=x.dtype, device=x.device)
                return
        pe = torch.zeros(x.size(1), self.embedding_dim)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.embedding_dim, 2, dtype=torch.float32)
                             * -(math.log(10000.0) / self.embedding_dim))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.pe = pe.to(device=x.device, dtype=x.dtype).detach()

    def forward(self, x):
        self.extend_pe(x)
        output = x.unsqueeze(-1) if x.ndim == 2 else x
        output = output * self.x_scale + self.alpha * self.pe[:, : x.size(1)]
        return self.dropout(output)


# ---------------------------------------------------------------- AR/models/t2s_model.py
def scaled_dot_product_attention(query, key, value, attn_mask: Optional[torch.Tensor] = None, scale=None):
    # the repo's own SDPA (added by the fix): boolean attn_mask, True = masked
    B, H, L, S = query.size(0), query.size(1), query.size(-2), key.size(-2)
    if scale is None:
        scale_factor = torch.tensor(1 / math.sqrt(query.size(-1)))
    else:
        scale_factor = scale
    attn_bias = torch.zeros(B, H, L, S, dtype=query.dtype, device=query.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_bias.masked_fill_(attn_mask, float("-inf"))
        else:
            attn_bias += attn_mask
    attn_weight = query @ key.transpose(-2, -1) * scale_factor
    attn_weight += attn_bias
    attn_weight = torch.softmax(attn_weight, dim=-1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_weight.masked_fill_(attn_mask, 0)
        else:
            attn_mask[attn_mask != float("-inf")] = 0
            attn_mask[attn_mask == float("-inf")] = 1
            attn_weight.masked_fill_(attn_mask, 0)
    return attn_weight @ value


class T2SMLP:
    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2

    def forward(self, x):
        x = F.relu(F.linear(x, self.w1, self.b1))
        x = F.linear(x, self.w2, self.b2)
        return x


class T2SBlock:
    def __init__(self, num_heads, hidden_dim, mlp, qkv_w, qkv_b, out_w, out_b,
                 norm_w1, norm_b1, norm_eps1, norm_w2, norm_b2, norm_eps2):
        self.num_heads = num_heads
        self.mlp = mlp
        self.hidden_dim = hidden_dim
        self.qkv_w, self.qkv_b = qkv_w, qkv_b
        self.out_w, self.out_b = out_w, out_b
        self.norm_w1, self.norm_b1, self.norm_eps1 = norm_w1, norm_b1, norm_eps1
        self.norm_w2, self.norm_b2, self.norm_eps2 = norm_w2, norm_b2, norm_eps2

    def to_mask(self, x, padding_mask):
        if padding_mask is None:
            return x
        if padding_mask.dtype == torch.bool:
            return x.masked_fill(padding_mask, 0)
        return x * padding_mask

    def process_prompt(self, x, attn_mask, padding_mask=None):
        q, k, v = F.linear(self.to_mask(x, padding_mask), self.qkv_w, self.qkv_b).chunk(3, dim=-1)

        batch_size = q.shape[0]
        q_len = q.shape[1]
        kv_len = k.shape[1]

        q = self.to_mask(q, padding_mask)
        k_cache = self.to_mask(k, padding_mask)
        v_cache = self.to_mask(v, padding_mask)

        q = q.view(batch_size, q_len, self.num_heads, -1).transpose(1, 2)
        k = k_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v = v_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)

        if FIXED:
            attn = scaled_dot_product_attention(q, k, v, attn_mask)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask)

        attn = attn.permute(2, 0, 1, 3).reshape(batch_size * q_len, self.hidden_dim)
        attn = attn.view(q_len, batch_size, self.hidden_dim).transpose(1, 0)
        attn = F.linear(self.to_mask(attn, padding_mask), self.out_w, self.out_b)

        x = self.to_mask(x + attn, padding_mask)
        x = F.layer_norm(x, [self.hidden_dim], self.norm_w1, self.norm_b1, self.norm_eps1)
        x = self.to_mask(x + self.mlp.forward(self.to_mask(x, padding_mask)), padding_mask)
        x = F.layer_norm(x, [self.hidden_dim], self.norm_w2, self.norm_b2, self.norm_eps2)
        return x, k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask: Optional[torch.Tensor] = None):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)

        k_cache = torch.cat([k_cache, k], dim=1)
        v_cache = torch.cat([v_cache, v], dim=1)

        batch_size = q.shape[0]
        q_len = q.shape[1]
        kv_len = k_cache.shape[1]

        q = q.view(batch_size, q_len, self.num_heads, -1).transpose(1, 2)
        k = k_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v = v_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)

        if FIXED:
            attn = scaled_dot_product_attention(q, k, v, attn_mask)
        else:
            attn = F.scaled_dot_product_attention(q, k, v)

        attn = attn.permute(2, 0, 1, 3).reshape(batch_size * q_len, self.hidden_dim)
        attn = attn.view(q_len, batch_size, self.hidden_dim).transpose(1, 0)
        attn = F.linear(attn, self.out_w, self.out_b)

        x = x + attn
        x = F.layer_norm(x, [self.hidden_dim], self.norm_w1, self.norm_b1, self.norm_eps1)
        x = x + self.mlp.forward(x)
        x = F.layer_norm(x, [self.hidden_dim], self.norm_w2, self.norm_b2, self.norm_eps2)
        return x, k_cache, v_cache


class T2STransformer:
    def __init__(self, num_blocks: int, blocks: List[T2SBlock]):
        self.num_blocks = num_blocks
        self.blocks = blocks

    def process_prompt(self, x, attn_mask, padding_mask=None):
        k_cache: List[torch.Tensor] = []
        v_cache: List[torch.Tensor] = []
        for i in range(self.num_blocks):
            x, k_cache_, v_cache_ = self.blocks[i].process_prompt(x, attn_mask, padding_mask)
            k_cache.append(k_cache_)
            v_cache.append(v_cache_)
        return x, k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask=None):
        for i in range(self.num_blocks):
            if FIXED:
                x, k_cache[i], v_cache[i] = self.blocks[i].decode_next_token(x, k_cache[i], v_cache[i], attn_mask)
            else:
                x, k_cache[i], v_cache[i] = self.blocks[i].decode_next_token(x, k_cache[i], v_cache[i])
        return x, k_cache, v_cache


class Text2SemanticDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model_dim = config["model"]["hidden_dim"]
        self.embedding_dim = config["model"]["embedding_dim"]
        self.num_head = config["model"]["head"]
        self.num_layers = config["model"]["n_layer"]
        self.vocab_size = config["model"]["vocab_size"]
        self.phoneme_vocab_size = config["model"]["phoneme_vocab_size"]
        self.p_dropout = config["model"]["dropout"]
        self.EOS = config["model"]["EOS"]
        assert self.EOS == self.vocab_size - 1
        self.bert_proj = nn.Linear(config["model"]["bert_dim"], self.embedding_dim)
        self.ar_text_embedding = TokenEmbedding(self.embedding_dim, self.phoneme_vocab_size, self.p_dropout)
        self.ar_text_position = SinePositionalEmbedding(self.embedding_dim, dropout=0.1, scale=False, alpha=True)
        self.ar_audio_embedding = TokenEmbedding(self.embedding_dim, self.vocab_size, self.p_dropout)
        self.ar_audio_position = SinePositionalEmbedding(self.embedding_dim, dropout=0.1, scale=False, alpha=True)

        self.h = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model=self.model_dim, nhead=self.num_head,
                                       dim_feedforward=self.model_dim * 4, dropout=0.1,
                                       batch_first=True, norm_first=False),
            num_layers=self.num_layers, enable_nested_tensor=False,
        )
        self.ar_predict_layer = nn.Linear(self.model_dim, self.vocab_size, bias=False)

        blocks = []
        for i in range(self.num_layers):
            layer = self.h.layers[i]
            t2smlp = T2SMLP(layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
            block = T2SBlock(
                self.num_head, self.model_dim, t2smlp,
                layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias,
                layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
                layer.norm1.weight, layer.norm1.bias, layer.norm1.eps,
                layer.norm2.weight, layer.norm2.bias, layer.norm2.eps,
            )
            blocks.append(block)
        self.t2s_transformer = T2STransformer(self.num_layers, blocks)

    @torch.no_grad()
    def infer_panel_batch_infer(self, x, x_lens, prompts, bert_feature, top_k=-100, top_p=100,
                                early_stop_num=-1, temperature=1.0, repetition_penalty=1.35, **kwargs):
        max_len = kwargs.get("max_len", x_lens.max())
        x_list = [self.ar_text_embedding(item) for item in x]
        x_list = [F.pad(item, (0, 0, 0, max_len - item.shape[0]), value=0) if item.shape[0] < max_len else item
                  for item in x_list]
        x = torch.stack(x_list, dim=0)

        bert_features_list = [self.bert_proj(item.transpose(0, 1)) for item in bert_feature]
        bert_features_list = [F.pad(item, (0, 0, 0, max_len - item.shape[0]), value=0)
                              if item.shape[0] < max_len else item for item in bert_features_list]
        bert_feature = torch.stack(bert_features_list, dim=0)

        x = x + bert_feature
        x = self.ar_text_position(x)

        # AR Decoder
        y = prompts
        x_len = x.shape[1]
        x_attn_mask = torch.zeros((x_len, x_len), dtype=torch.bool)
        stop = False

        k_cache = None
        v_cache = None
        # first step
        y_emb = self.ar_audio_embedding(y)
        y_len = y_emb.shape[1]
        prefix_len = y.shape[1]
        y_lens = torch.LongTensor([y_emb.shape[1]] * y_emb.shape[0]).to(x.device)
        y_pos = self.ar_audio_position(y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)

        # create mask
        bsz = x.shape[0]
        src_len = x_len + y_len
        y_paddind_mask = make_pad_mask(y_lens, y_len)
        x_paddind_mask = make_pad_mask(x_lens, max_len)

        # (bsz, x_len + y_len)
        xy_padding_mask = torch.concat([x_paddind_mask, y_paddind_mask], dim=1)

        x_mask = F.pad(x_attn_mask, (0, y_len), value=True)
        y_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)

        if FIXED:
            xy_mask = torch.concat([x_mask, y_mask], dim=0).view(1, src_len, src_len).repeat(bsz, 1, 1).to(x.device)
            _xy_padding_mask = xy_padding_mask.view(bsz, 1, src_len).repeat(1, src_len, 1)
            for i in range(bsz):
                l = x_lens[i]
                _xy_padding_mask[i, l:max_len, :] = True
            xy_attn_mask = xy_mask.logical_or(_xy_padding_mask)
            xy_attn_mask = xy_attn_mask.unsqueeze(1).expand(-1, self.num_head, -1, -1)
            xy_attn_mask = xy_attn_mask.bool()
            xy_padding_mask = xy_padding_mask.view(bsz, src_len, 1).expand(-1, -1, self.model_dim)
        else:
            xy_mask = torch.concat([x_mask, y_mask], dim=0).view(1, src_len, src_len).expand(bsz, -1, -1).to(x.device)
            _xy_padding_mask = xy_padding_mask.view(bsz, 1, src_len).expand(-1, src_len, src_len)
            xy_attn_mask = xy_mask.logical_or(_xy_padding_mask)
            xy_attn_mask = xy_attn_mask.unsqueeze(1).expand(-1, self.num_head, -1, -1)
            new_attn_mask = torch.zeros_like(xy_attn_mask, dtype=x.dtype)
            xy_attn_mask = new_attn_mask.masked_fill(xy_attn_mask, float("-inf"))
            xy_padding_mask = ~xy_padding_mask.view(bsz, src_len, 1).expand(-1, -1, self.model_dim)
            xy_padding_mask = xy_padding_mask.to(dtype=x.dtype)

        # decode
        y_list = [None] * y.shape[0]
        batch_idx_map = list(range(y.shape[0]))
        idx_list = [None] * y.shape[0]
        for idx in range(1500):
            if idx == 0:
                xy_dec, k_cache, v_cache = self.t2s_transformer.process_prompt(xy_pos, xy_attn_mask, xy_padding_mask)
            else:
                xy_dec, k_cache, v_cache = self.t2s_transformer.decode_next_token(xy_pos, k_cache, v_cache,
                                                                                  xy_attn_mask)

            logits = self.ar_predict_layer(xy_dec[:, -1])

            if FIXED:
                if idx == 0:
                    xy_attn_mask = F.pad(xy_attn_mask[:, :, -1].unsqueeze(-2), (0, 1), value=False)
                    logits = logits[:, :-1]
                else:
                    xy_attn_mask = F.pad(xy_attn_mask, (0, 1), value=False)
            else:
                if idx == 0:
                    xy_attn_mask = None
                    logits = logits[:, :-1]

            samples = sample(logits, y, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                             temperature=temperature)[0]

            y = torch.concat([y, samples], dim=1)

            # remove finished sequences from the batch
            reserved_idx_of_batch_for_y = None
            if (self.EOS in samples[:, 0]) or (self.EOS in torch.argmax(logits, dim=-1)):
                l = samples[:, 0] == self.EOS
                removed_idx_of_batch_for_y = torch.where(l == True)[0].tolist()
                reserved_idx_of_batch_for_y = torch.where(l == False)[0]
                for i in removed_idx_of_batch_for_y:
                    batch_index = batch_idx_map[i]
                    idx_list[batch_index] = idx - 1
                    y_list[batch_index] = y[i, :-1]
                batch_idx_map = [batch_idx_map[i] for i in reserved_idx_of_batch_for_y.tolist()]

            if reserved_idx_of_batch_for_y is not None:
                y = torch.index_select(y, dim=0, index=reserved_idx_of_batch_for_y)
                if FIXED:
                    xy_attn_mask = torch.index_select(xy_attn_mask, dim=0, index=reserved_idx_of_batch_for_y)
                if k_cache is not None:
                    for i in range(len(k_cache)):
                        k_cache[i] = torch.index_select(k_cache[i], dim=0, index=reserved_idx_of_batch_for_y)
                        v_cache[i] = torch.index_select(v_cache[i], dim=0, index=reserved_idx_of_batch_for_y)

            if (early_stop_num != -1 and (y.shape[1] - prefix_len) > early_stop_num) or idx == 1499:
                print("use early stop num:", early_stop_num)
                stop = True
                for i, batch_index in enumerate(batch_idx_map):
                    batch_index = batch_idx_map[i]
                    idx_list[batch_index] = idx
                    y_list[batch_index] = y[i, :-1]

            if not (None in idx_list):
                stop = True

            if stop:
                print(f"T2S Decoding EOS [{prefix_len} -> {y.shape[1]}]")
                break

            # update next step
            y_emb = self.ar_audio_embedding(y[:, -1:])
            xy_pos = y_emb * self.ar_audio_position.x_scale + self.ar_audio_position.alpha * \
                self.ar_audio_position.pe[:, y_len + idx].to(dtype=y_emb.dtype, device=y_emb.device)

        return y_list, idx_list


def main():
    torch.manual_seed(0)
    config = {"model": {"hidden_dim": 32, "embedding_dim": 32, "head": 4, "n_layer": 2, "vocab_size": 65,
                        "phoneme_vocab_size": 40, "dropout": 0.0, "EOS": 64, "bert_dim": 16}}
    model = Text2SemanticDecoder(config).eval()
    # sharper output head, closer to a trained checkpoint than the default init
    nn.init.normal_(model.ar_predict_layer.weight, std=1.0)

    # two sentences of different phoneme length (the batch is right-padded to max_len inside infer)
    phones = [torch.randint(1, 40, (12,)), torch.randint(1, 40, (3,))]
    bert = [torch.randn(16, 12), torch.randn(16, 3)]
    x_lens = torch.LongTensor([12, 3])
    # the same reference-audio semantic prompt for both (as TTS.py batches it)
    prompt = torch.randint(0, 64, (1, 6))
    prompts = prompt.repeat(2, 1)

    torch.manual_seed(1)
    y_list, idx_list = model.infer_panel_batch_infer(phones, x_lens, prompts, bert, top_k=3, top_p=1,
                                                     temperature=1.0, early_stop_num=12,
                                                     repetition_penalty=1.35)
    for b, (yy, n) in enumerate(zip(y_list, idx_list)):
        print(f"sentence {b}: idx={n} semantic tokens={yy[6:].tolist()}")

    print("checksum:", sum(int(t.sum()) for t in y_list))


if __name__ == "__main__":
    main()
