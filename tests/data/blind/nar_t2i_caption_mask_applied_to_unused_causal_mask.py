# NAR, Neighboring Autoregressive image generation (ThisisBillhe/NAR commit c84280f, "fix bugs with attention
# masks"; NAR-images/autoregressive/models/gpt.py, models/generate.py and sample/sample_t2i.py read at c84280f^
# and at c84280f).
# Bug: text-to-image sampling left-pads the T5 caption (cls_token_num slots) and `generate` multiplies its
# emb_masks into `model.causal_mask` (and puts the eye back on it), but `Transformer.forward` builds its
# attention mask from `model.diagonal_mask`, which setup_caches filled with the plain tril over the caption and
# the neighbouring (same-or-earlier anti-diagonal) pattern over the image grid; the caption pad slots are never
# masked, in the prefill or in any decode step.
# Fix: one `proximity_mask` buffer is built in setup_caches, read by forward and masked with emb_masks in
# generate.
# T5 is a stand-in (random caption features and their 0/1 masks); the model is tiny with random weights, and the
# zero-initialised output head is filled as a loaded checkpoint would fill it.
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FIXED = "--fixed" in sys.argv


def find_multiple(n: int, k: int):
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: Optional[int] = None
    multiple_of: int = 256  # make SwiGLU hidden layer size multiple of large power of 2
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    initializer_range: float = 0.02

    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    drop_path_rate: float = 0.0

    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = 'c2i'

    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256
    max_batch_size: int = 32
    max_seq_len: int = 2048

    medusa_attention_num: int = 1


#################################################################################
#                      Embedding Layers for Text Feature                        #
#################################################################################
class CaptionEmbedder(nn.Module):
    """
    Embeds text caption into vector representations. Also handles label dropout for classifier-free guidance.
    """
    def __init__(self, in_channels, hidden_size, uncond_prob, token_num=120):
        super().__init__()
        self.cap_proj = MLP(in_features=in_channels, hidden_features=hidden_size, out_features=hidden_size)
        self.register_buffer("uncond_embedding", nn.Parameter(torch.randn(token_num, in_channels) / in_channels ** 0.5))
        self.uncond_prob = uncond_prob

    def token_drop(self, caption, force_drop_ids=None):
        if force_drop_ids is None:
            drop_ids = torch.rand(caption.shape[0], device=caption.device) < self.uncond_prob
        else:
            drop_ids = force_drop_ids == 1
        caption = torch.where(drop_ids[:, None, None], self.uncond_embedding, caption)
        return caption

    def forward(self, caption, train, force_drop_ids=None):
        use_dropout = self.uncond_prob > 0
        if (train and use_dropout) or (force_drop_ids is not None):
            caption = self.token_drop(caption, force_drop_ids)
        embeddings = self.cap_proj(caption)
        return embeddings


class MLP(nn.Module):
    def __init__(self, in_features, hidden_features, out_features):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate='tanh')
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.fc2(x)
        return x


#################################################################################
#                                  GPT Model                                    #
#################################################################################
class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        hidden_dim = 4 * config.dim
        hidden_dim = int(2 * hidden_dim / 3)
        if config.ffn_dim_multiplier is not None:
            hidden_dim = int(config.ffn_dim_multiplier * hidden_dim)
        hidden_dim = find_multiple(hidden_dim, config.multiple_of)

        self.w1 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)

    def forward(self, x):
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_head, head_dim, dtype):
        super().__init__()
        cache_shape = (max_batch_size, n_head, max_seq_length, head_dim)
        self.register_buffer('k_cache', torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer('v_cache', torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val

        return k_out, v_out


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0
        self.dim = config.dim
        self.head_dim = config.dim // config.n_head
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head if config.n_kv_head is not None else config.n_head
        total_kv_dim = (self.n_head + 2 * self.n_kv_head) * self.head_dim

        # key, query, value projections for all heads, but in a batch
        self.wqkv = nn.Linear(config.dim, total_kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

        # regularization
        self.attn_dropout_p = config.attn_dropout_p
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor = None,
        input_pos: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None
    ):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        xq, xk, xv = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        xq = xq.view(bsz, seqlen, self.n_head, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_head, self.head_dim)

        xq = apply_rotary_emb(xq, freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis)

        xq, xk, xv = map(lambda x: x.transpose(1, 2), (xq, xk, xv))

        if self.kv_cache is not None:
            keys, values = self.kv_cache.update(input_pos, xk, xv)
        else:
            keys, values = xk, xv
        keys = keys.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        values = values.repeat_interleave(self.n_head // self.n_kv_head, dim=1)

        output = F.scaled_dot_product_attention(
            xq, keys, values,
            attn_mask=mask,
            is_causal=True if mask is None else False, # is_causal=False is for KV cache
            dropout_p=self.attn_dropout_p if self.training else 0)

        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        output = self.resid_dropout(self.wo(output))
        return output


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, drop_path: float):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.drop_path = nn.Identity()  # drop_path_rate = 0.

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, start_pos: int, mask: Optional[torch.Tensor] = None):
        h = x + self.drop_path(self.attention(self.attention_norm(x), freqs_cis, start_pos, mask))
        out = h + self.drop_path(self.feed_forward(self.ffn_norm(h)))
        return out


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.n_layer = config.n_layer
        self.block_size = config.block_size
        self.num_classes = config.num_classes
        self.model_type = config.model_type
        self.cls_token_num = config.cls_token_num
        self.medusa_attention_num = config.medusa_attention_num
        if self.model_type == 't2i':
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim, config.class_dropout_prob,
                                                 token_num=config.cls_token_num)
        else:
            raise Exception("please check model type")
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)

        # transformer blocks
        dpr = [x.item() for x in torch.linspace(0, config.drop_path_rate, config.n_layer + config.medusa_attention_num)]
        self.layers = torch.nn.ModuleList()
        for layer_id in range(config.n_layer + config.medusa_attention_num):
            self.layers.append(TransformerBlock(config, dpr[layer_id]))

        # output layer
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

        # medusa output layer
        self.medusa_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.medusa_output = nn.Linear(config.dim, config.vocab_size, bias=False)

        # 2d rotary pos embedding
        grid_size = int(self.block_size ** 0.5)
        assert grid_size * grid_size == self.block_size
        self.grid_size = grid_size
        self.freqs_cis = precompute_freqs_cis_2d(grid_size, self.config.dim // self.config.n_head, self.config.rope_base, self.cls_token_num)

        # KVCache
        self.max_batch_size = -1
        self.max_seq_length = -1

        self.initialize_weights()

    def initialize_weights(self):
        # Initialize nn.Linear and nn.Embedding
        self.apply(self._init_weights)

        # Zero-out output layers:
        nn.init.constant_(self.output.weight, 0)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)

    # ---- before the fix: the neighbouring mask is called the diagonal mask
    def setup_diagonal_mask(self, mask, block_size):
        grid_size = int(block_size ** 0.5)
        for token_id in range(block_size):
            mask[token_id, :] = 0
            row_id = token_id // grid_size
            column_id = token_id % grid_size

            t_row_id = row_id
            t_column_id = column_id
            while t_row_id >= 0:
                low = t_row_id * grid_size
                high = t_row_id * grid_size + min(t_column_id + 1, grid_size)
                mask[token_id, low: high] = 1

                t_row_id -= 1
                t_column_id += 1

            t_row_id = row_id
            t_column_id = column_id
            while t_row_id < grid_size:
                low = t_row_id * grid_size
                high = t_row_id * grid_size + max(t_column_id + 1, 0)
                mask[token_id, low: high] = 1

                t_row_id += 1
                t_column_id -= 1
        return mask

    # ---- after the fix
    def setup_proximity_mask(self, mask, block_size):
        mask[:, :] = 0 # zero out visual attention mask
        cur_token, previous_token = [], []
        H, W = int(block_size ** 0.5), int(block_size ** 0.5) # height and width of the token map
        for c in range(H + W - 1): # c is the Manhattan distance from the initial token x0
            cur_token = []
            for h in range(H):
                w = c - h # obtain coordinates (h, w) on the same slash
                if 0 <= w < W:
                    token_id = (h * W + w)
                    cur_token.append(token_id)
                    previous_token.append(token_id)
            for id in cur_token:
                mask[id, previous_token] = 1

    def setup_caches(self, max_batch_size, max_seq_length, dtype):
        head_dim = self.config.dim // self.config.n_head
        max_seq_length = find_multiple(max_seq_length, 8)
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.config.n_head, head_dim, dtype)

        grid_size = int(self.config.block_size ** 0.5)
        assert grid_size * grid_size == self.config.block_size
        if not FIXED:
            diagonal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))
            low = self.cls_token_num
            high = self.cls_token_num + self.config.block_size
            self.setup_diagonal_mask(
                diagonal_mask[low: high, low: high],
                self.config.block_size
            )
            self.diagonal_mask = diagonal_mask.unsqueeze(0).repeat(self.max_batch_size, 1, 1)

            causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))
            self.causal_mask = causal_mask.unsqueeze(0).repeat(self.max_batch_size, 1, 1)
        else:
            proximity_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))
            low = self.cls_token_num
            high = self.cls_token_num + self.config.block_size
            self.setup_proximity_mask(
                proximity_mask[low: high, low: high],
                self.config.block_size,
            )
            self.proximity_mask = proximity_mask.unsqueeze(0).repeat(self.max_batch_size, 1, 1)
        self.freqs_cis = precompute_freqs_cis_2d(grid_size, self.config.dim // self.config.n_head, self.config.rope_base, self.cls_token_num)

    def forward(
        self,
        idx: torch.Tensor,
        cond_idx: torch.Tensor,  # cond_idx_or_embed
        accept_first_last: Optional[bool] = False,
        input_pos:  Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
    ):
        if cond_idx is not None: # prefill in inference
            token_embeddings = self.cls_embedding(cond_idx, train=self.training)[:,:self.cls_token_num]
        else: # decode_n_tokens(kv cache) in inference
            token_embeddings = self.tok_embeddings(idx)

        bs = token_embeddings.shape[0]
        if not FIXED:
            # mask = self.causal_mask[:bs, None, input_pos]
            mask = self.diagonal_mask[:bs, None, input_pos]
        else:
            mask = self.proximity_mask[:bs, None, input_pos]
        h = self.tok_dropout(token_embeddings)

        freqs_cis = self.freqs_cis[input_pos]
        # transformer blocks
        medusa_h = h
        for layer_num, layer in enumerate(self.layers):
            medusa_h = layer(medusa_h, freqs_cis, input_pos, mask)
            # hidden states for predicting Right tokens
            if layer_num == self.n_layer - 1:
                h = medusa_h

        # output layers
        h = self.norm(h)
        logitsR = self.output(h).float() # logitsR represents the logits of the token on the right
        # medusa output layers
        medusa_h = self.medusa_norm(medusa_h)
        logitsB = self.medusa_output(medusa_h).float() # LogitsB represents the logits of the token below

        if cond_idx is not None: # prefill in inference
            logitsR = logitsR[:, -1:, :]
            logitsB = logitsB[:, -1:, :]
            logits = (logitsB + logitsR) / 2 # left top token prediction
        else: # inference
            first = logitsR[:, 0, :]
            last = logitsB[:, -1, :]
            middle = (logitsB[:, :-1, :] + logitsR[:, 1:, :]) / 2
            if accept_first_last:
                logits = torch.cat([first[:, None, :], middle, last[:, None, :]], dim=1)
            else:
                logits = middle

        return logits, None


#################################################################################
#                      Rotary Positional Embedding Functions                    #
#################################################################################
def precompute_freqs_cis_2d(grid_size: int, n_elem: int, base: int = 10000, cls_token_num=120):
    # split the dimension into half, one for x and one for y
    half_dim = n_elem // 2
    freqs = 1.0 / (base ** (torch.arange(0, half_dim, 2)[: (half_dim // 2)].float() / half_dim))
    t = torch.arange(grid_size, device=freqs.device)
    freqs = torch.outer(t, freqs) # (grid_size, head_dim // 2)
    freqs_grid = torch.concat([
        freqs[:, None, :].expand(-1, grid_size, -1),
        freqs[None, :, :].expand(grid_size, -1, -1),
    ], dim=-1)  # (grid_size, grid_size, head_dim // 2)
    cache_grid = torch.stack([torch.cos(freqs_grid), torch.sin(freqs_grid)], dim=-1) # (grid_size, grid_size, head_dim // 2, 2)
    cache = cache_grid.flatten(0, 1)
    cond_cache = torch.cat([torch.zeros(cls_token_num, n_elem // 2, 2), cache]) # (cls_token_num+grid_size**2, head_dim // 2, 2)
    return cond_cache


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor):
    # x: (bs, seq_len, n_head, head_dim)
    # freqs_cis (seq_len, head_dim // 2, 2)
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2) # (bs, seq_len, n_head, head_dim//2, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2) # (1, seq_len, 1, head_dim//2, 2)
    x_out2 = torch.stack([
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
    ], dim=-1)
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


#################################################################################
#                      autoregressive/models/generate.py                        #
#################################################################################
def top_k_top_p_filtering(logits, top_k: int = 0, top_p: float = 1.0, filter_value: float = -float("Inf"),
                          min_tokens_to_keep: int = 1):
    if top_k > 0:
        top_k = min(max(top_k, min_tokens_to_keep), logits.size(-1))  # Safety check
        indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
        logits[indices_to_remove] = filter_value
    return logits


def sample(all_logits, temperature: float=1.0, top_k: int=0, top_p: float=1.0, sample_logits=True):
    accept_token_num = all_logits.shape[1]
    all_idx = []
    for i in range(accept_token_num):
        logits = all_logits[:, i, :] / max(temperature, 1e-5)
        if top_k > 0 or top_p < 1.0:
            logits = top_k_top_p_filtering(logits, top_k=top_k, top_p=top_p)
        probs = F.softmax(logits, dim=-1)
        if sample_logits:
            idx = torch.multinomial(probs, num_samples=1)
        else:
            _, idx = torch.topk(probs, k=1, dim=-1)
        all_idx.append(idx.view(-1, 1))
    all_idx = torch.cat(all_idx, dim=-1)

    return all_idx


def prefill(model, cond_idx: torch.Tensor, input_pos: torch.Tensor, cfg_scale: float, **sampling_kwargs):
    if cfg_scale > 1.0:
        logits, _ = model(None, cond_idx, input_pos=input_pos)
        logits_combined = logits
        cond_logits, uncond_logits = torch.split(logits_combined, len(logits_combined) // 2, dim=0)
        logits = uncond_logits + (cond_logits - uncond_logits) * cfg_scale
    else:
        logits, _ = model(None, cond_idx, input_pos=input_pos)

    return sample(logits, **sampling_kwargs)


def decode_diagonal_token(
    model,
    x: torch.Tensor,
    input_pos: torch.Tensor,
    cfg_scale: float,
    cfg_flag: bool,
    accept_token_num: int,
    accept_first_last: bool,
    **sampling_kwargs
):
    if cfg_scale > 1.0:
        x_combined = torch.cat([x, x])
        logits, _ = model(x_combined, cond_idx=None, input_pos=input_pos, accept_first_last=accept_first_last)
        logits_combined = logits
        cond_logits, uncond_logits = torch.split(logits_combined, len(logits_combined) // 2, dim=0)
        if cfg_flag:
            logits = uncond_logits + (cond_logits - uncond_logits) * cfg_scale
        else:
            logits = cond_logits
    else:
        logits, _ = model(x, cond_idx=None, input_pos=input_pos, accept_first_last=accept_first_last)
    return sample(logits, **sampling_kwargs)


def decode_n_tokens(
    model, cur_token: torch.Tensor, input_pos: torch.Tensor, num_new_tokens: int,
    cfg_scale: float, cfg_interval: int,
    grid_size: int,
    **sampling_kwargs):
    new_tokens = [[] for _ in range(grid_size)]
    new_tokens[0].append(cur_token)

    cfg_flag = True
    tot_diagonal_num = 2 * grid_size - 1
    token_num = 1
    bias = input_pos.item()

    for diagonal in range(1, tot_diagonal_num):
        with sdpa_kernel(SDPBackend.MATH): # Actually better for Inductor to codegen attention here
            accept_token_num = diagonal + 1 if diagonal < grid_size else tot_diagonal_num - diagonal
            if cfg_interval > -1 and token_num > cfg_interval:
                cfg_flag = False

            next_token = decode_diagonal_token(
                model, cur_token, input_pos, cfg_scale, cfg_flag, accept_token_num, accept_first_last=diagonal<grid_size, **sampling_kwargs
            )
            cur_token = next_token

            input_pos = []
            for i in range(0, grid_size):
                j = diagonal - i
                if j < 0 or j >= grid_size:
                    continue
                input_pos.append(bias + i * grid_size + j)
            input_pos = torch.tensor(input_pos)

            i = 0
            for token_arr in new_tokens:
                if i >= cur_token.shape[1]:
                    break
                if len(token_arr) < grid_size:
                    token_arr.append(cur_token[:, i].view(-1, 1))
                    i += 1

            token_num += accept_token_num

    new_tokens = torch.cat([torch.cat(token_arr, dim=-1) for token_arr in new_tokens], dim=-1)
    return new_tokens[:, 1:], None


@torch.no_grad()
def generate(model, cond, max_new_tokens, emb_masks=None, cfg_scale=1.0, cfg_interval=-1, **sampling_kwargs):
    if model.model_type == 't2i':
        if cfg_scale > 1.0:
            cond_null = torch.zeros_like(cond) + model.cls_embedding.uncond_embedding
            cond_combined = torch.cat([cond, cond_null])
        else:
            cond_combined = cond
        T = cond.shape[1]
    else:
        raise Exception("please check model type")

    T_new = T + max_new_tokens
    max_seq_length = T_new
    max_batch_size = cond.shape[0]

    device = cond.device
    with torch.device(device):
        max_batch_size_cfg = max_batch_size * 2 if cfg_scale > 1.0 else max_batch_size
        model.setup_caches(max_batch_size=max_batch_size_cfg, max_seq_length=max_seq_length, dtype=model.tok_embeddings.weight.dtype)

    if not FIXED:
        # TODO: change model.diagonal_mask at case `t2i`
        if emb_masks is not None:
            assert emb_masks.shape[0] == max_batch_size
            assert emb_masks.shape[-1] == T
            if cfg_scale > 1.0:
                model.causal_mask[:, :, :T] = model.causal_mask[:, :, :T] * torch.cat([emb_masks, emb_masks]).unsqueeze(1)
            else:
                model.causal_mask[:, :, :T] = model.causal_mask[:, :, :T] * emb_masks.unsqueeze(1)

            eye_matrix = torch.eye(model.causal_mask.size(1), model.causal_mask.size(2), device=device)
            model.causal_mask[:] = model.causal_mask * (1 - eye_matrix) + eye_matrix
    else:
        # Setup proximity_mask for t2i task
        if emb_masks is not None:
            assert emb_masks.shape[0] == max_batch_size
            assert emb_masks.shape[-1] == T
            if cfg_scale > 1.0:
                model.proximity_mask[:, :, :T] = model.proximity_mask[:, :, :T] * torch.cat([emb_masks, emb_masks]).unsqueeze(1)
            else:
                model.proximity_mask[:, :, :T] = model.proximity_mask[:, :, :T] * emb_masks.unsqueeze(1)

            eye_matrix = torch.eye(model.proximity_mask.size(1), model.proximity_mask.size(2), device=device)
            model.proximity_mask[:] = model.proximity_mask * (1 - eye_matrix) + eye_matrix

    # create an empty tensor of the expected final shape and fill in the current tokens
    seq = torch.empty((max_batch_size, T_new), dtype=torch.int, device=device)

    input_pos = torch.arange(0, T, device=device)
    next_token = prefill(model, cond_combined, input_pos, cfg_scale, **sampling_kwargs)
    seq[:, T:T+1] = next_token

    input_pos = torch.tensor([T], device=device, dtype=torch.int)
    grid_size = int(max_new_tokens ** 0.5)
    generated_tokens, _ = decode_n_tokens(model, next_token, input_pos, max_new_tokens-1, cfg_scale, cfg_interval, grid_size, **sampling_kwargs)
    seq[:, T+1:] = generated_tokens

    return seq[:, T:]


#################################################################################
#                      autoregressive/sample/sample_t2i.py                      #
#################################################################################
def main():
    torch.manual_seed(0)
    t5_feature_max_len = 8   # --t5-feature-max-len (cls_token_num)
    t5_feature_dim = 16      # --t5-feature-dim
    latent_size = 4          # image_size // downsample_size
    gpt_model = Transformer(ModelArgs(
        n_layer=2, n_head=2, dim=32, multiple_of=16, vocab_size=64,
        block_size=latent_size ** 2, cls_token_num=t5_feature_max_len, model_type="t2i",
        caption_dim=t5_feature_dim,
    ))
    nn.init.normal_(gpt_model.output.weight, std=0.5)      # the checkpoint's head (zero at init)
    nn.init.normal_(gpt_model.medusa_output.weight, std=0.5)
    gpt_model.eval()

    # t5_model.get_text_embeddings(prompts): right-padded to t5_feature_max_len, mask 1 = real token
    prompt_lens = [6, 3]
    caption_embs = torch.randn(len(prompt_lens), t5_feature_max_len, t5_feature_dim)
    emb_masks = torch.zeros(len(prompt_lens), t5_feature_max_len, dtype=torch.long)
    for b, n in enumerate(prompt_lens):
        emb_masks[b, :n] = 1

    # a naive way to implement left-padding
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    new_caption_embs = []
    for idx, (caption_emb, emb_mask) in enumerate(zip(caption_embs, emb_masks)):
        valid_num = int(emb_mask.sum().item())
        print(f'  prompt {idx} token len: {valid_num}')
        new_caption_emb = torch.cat([caption_emb[valid_num:], caption_emb[:valid_num]])
        new_caption_embs.append(new_caption_emb)
    new_caption_embs = torch.stack(new_caption_embs)
    c_indices = new_caption_embs * new_emb_masks[:, :, None]
    c_emb_masks = new_emb_masks

    torch.manual_seed(888)
    index_sample = generate(
        gpt_model, c_indices, latent_size ** 2,
        c_emb_masks,
        cfg_scale=4.0,
        temperature=1.0, top_k=0,
        top_p=1.0, sample_logits=True,
    )
    for b in range(index_sample.shape[0]):
        print(f"image {b} codes:", index_sample[b].view(latent_size, latent_size).tolist())


if __name__ == "__main__":
    main()
