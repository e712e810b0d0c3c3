# lucidrains/reformer-pytorch commit e8d1759 ("fix a big bug with attention chunking and masks"): LSHSelfAttention
# merged heads into the batch ((b h) rows) and split them into attn_chunks, but passed the un-expanded (b, kv_len)
# padding mask whole to every chunk, so with attn_chunks == heads each chunk's rows got other sequences' masks.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from functools import partial

FIXED = "--fixed" in sys.argv

#constants

TOKEN_SELF_ATTN_VALUE = -5e4 # carefully set for half precision to work

# helper fns

if FIXED:
    def process_inputs_chunk(fn, chunks=1, dim=0):
        def inner_fn(*args, **kwargs):
            keys, values, len_args = kwargs.keys(), kwargs.values(), len(args)
            chunked_args = list(zip(*map(lambda x: x.chunk(chunks, dim=dim), list(args) + list(values))))
            all_args = map(lambda x: (x[:len_args], dict(zip(keys, x[len_args:]))), chunked_args)
            outputs = [fn(*c_args, **c_kwargs) for c_args, c_kwargs in all_args]
            return tuple(map(lambda x: torch.cat(x, dim=dim), zip(*outputs)))
        return inner_fn
else:
    def process_inputs_chunk(fn, *args, chunks=1, dim=0):
        chunked_inputs = list(map(lambda x: x.chunk(chunks, dim=dim), args))
        outputs = [fn(*input_pair) for input_pair in zip(*chunked_inputs)]
        return tuple(map(lambda x: torch.cat(x, dim=dim), zip(*outputs)))

def default(val, default_val):
    return default_val if val is None else val

def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max

# simple full attention

class FullQKAttention(nn.Module):
    def __init__(self, causal = False):
        super().__init__()
        self.causal = causal

    def forward(self, qk, v, query_len = None, input_mask = None, input_attn_mask = None):
        b, seq_len, dim = qk.shape
        query_len = default(query_len, seq_len)
        t = query_len

        q = qk[:, 0:query_len]
        qk = F.normalize(qk, 2, dim=-1).type(q.type())

        dot = torch.einsum('bie,bje->bij', q, qk) * (dim ** -0.5)

        # qk attention requires tokens not attend to self
        i = torch.arange(t)
        dot[:, i, i] = TOKEN_SELF_ATTN_VALUE
        masked_value = max_neg_value(dot)

        # Input mask for padding in variable lengthed sequences
        if input_mask is not None:
            mask = input_mask[:, 0:query_len, None] * input_mask[:, None, :]
            mask = F.pad(mask, (0, seq_len - mask.shape[-1]), value=True)
            dot.masked_fill_(~mask, masked_value)

        # Mask for post qk attention logits of the input sequence
        if input_attn_mask is not None:
            input_attn_mask = F.pad(input_attn_mask, (0, seq_len - input_attn_mask.shape[-1]), value=True)
            dot.masked_fill_(~input_attn_mask, masked_value)

        if self.causal:
            i, j = torch.triu_indices(t, t, 1)
            dot[:, i, j] = masked_value

        dot = dot.softmax(dim=-1)
        out = torch.einsum('bij,bje->bie', dot, v)

        return out, dot, torch.empty(0)

# Shared qk attention, using either full or LSH attention
# (trimmed: the LSHAttention branch is not built; this repro runs use_full_attn = True, the project's
#  full-attention path, so the output is deterministic. Both branches received the same `mask`.)

class LSHSelfAttention(nn.Module):
    def __init__(self, dim, heads = 8, bucket_size = 64, n_hashes = 8, causal = False, attn_chunks = 1, num_mem_kv = 0, one_value_head = False, use_full_attn = False, full_attn_thres = None, **kwargs):
        super().__init__()
        assert dim % heads == 0, 'dimensions must be divisible by number of heads'

        self.dim = dim
        self.heads = heads
        self.attn_chunks = default(attn_chunks, 1) if FIXED else attn_chunks

        self.v_head_repeats = (heads if one_value_head else 1)
        v_dim = dim // self.v_head_repeats

        self.toqk = nn.Linear(dim, dim, bias = False)
        self.tov = nn.Linear(dim, v_dim, bias = False)
        self.to_out = nn.Linear(dim, dim)

        self.bucket_size = bucket_size
        self.full_attn = FullQKAttention(causal = causal)

        self.use_full_attn = use_full_attn
        self.full_attn_thres = default(full_attn_thres, bucket_size)

        self.num_mem_kv = num_mem_kv
        self.mem_kv = nn.Parameter(torch.randn(1, num_mem_kv, dim, requires_grad=True)) if num_mem_kv > 0 else None

        self.callback = None

    def forward(self, x, keys = None, input_mask = None, input_attn_mask = None, context_mask = None):
        device, dtype = x.device, x.dtype
        b, t, e, h, m = *x.shape, self.heads, self.num_mem_kv

        mem_kv = default(self.mem_kv, torch.empty(b, 0, e, dtype=dtype, device=device))
        mem = mem_kv.expand(b, m, e)

        keys = default(keys, torch.empty(b, 0, e, dtype=dtype, device=device))
        c = keys.shape[1]

        kv_len = t + m + c
        use_full_attn = self.use_full_attn or kv_len <= self.full_attn_thres
        assert use_full_attn, 'this reproduction only builds the full-attention branch'

        x = torch.cat((x, mem, keys), dim=1)
        qk = self.toqk(x)
        v = self.tov(x)
        v = v.repeat(1, 1, self.v_head_repeats)

        def merge_heads(v):
            return v.view(b, kv_len, h, -1).transpose(1, 2).reshape(b * h, kv_len, -1)

        def split_heads(v):
            return v.view(b, h, t, -1).transpose(1, 2).contiguous()

        qk = merge_heads(qk)
        v = merge_heads(v)

        attn_fn = self.full_attn

        if FIXED:
            masks = {}
            if input_mask is not None or context_mask is not None:
                default_mask = torch.tensor([True], device=device)
                i_mask = default(input_mask, default_mask.expand(b, t))
                m_mask = default_mask.expand(b, m)
                c_mask = default(context_mask, default_mask.expand(b, c))
                mask = torch.cat((i_mask, m_mask, c_mask), dim=1)
                mask = mask[:, None, :].expand(b, h, kv_len).reshape(b * h, kv_len)
                masks['input_mask'] = mask

            if input_attn_mask is not None:
                input_attn_mask = input_attn_mask[:, None, :, :].expand(b, h, t, t).reshape(b * h, t, t)
                masks['input_attn_mask'] = input_attn_mask

            partial_attn_fn = partial(attn_fn, query_len = t)
            attn_fn_in_chunks = process_inputs_chunk(partial_attn_fn, chunks = self.attn_chunks)
            out, attn, buckets = attn_fn_in_chunks(qk, v, **masks)
        else:
            mask = None
            if input_mask is not None or context_mask is not None:
                default_mask = torch.tensor([True], device=device)
                i_mask = default(input_mask, default_mask.expand(b, t))
                m_mask = default_mask.expand(b, m)
                c_mask = default(context_mask, default_mask.expand(b, c))
                mask = torch.cat((i_mask, m_mask, c_mask), dim=1)

            partial_attn_fn = partial(attn_fn, query_len = t, input_mask = mask, input_attn_mask = input_attn_mask)
            out, attn, buckets = process_inputs_chunk(partial_attn_fn, qk, v, chunks=self.attn_chunks)
        out = split_heads(out).view(b, t, e)

        return self.to_out(out)


torch.manual_seed(0)
heads = 4
# attn_chunks = heads, as in the project's README example (heads = 8, attn_chunks = 8): each chunk then holds b rows
attn = LSHSelfAttention(dim = 32, heads = heads, bucket_size = 8, causal = False, attn_chunks = heads,
                        use_full_attn = True).eval()
lens = [9, 16]
T = max(lens)
x = torch.randn(len(lens), T, 32)
input_mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]    # True = real token, right padding

with torch.no_grad():
    batched = attn(x, input_mask = input_mask)
    diffs = []
    for i, n in enumerate(lens):
        alone = attn(x[i:i + 1, :n])                                     # the sequence by itself, no padding
        diffs.append((batched[i, :n] - alone[0]).abs().max().item())
print(f"reformer LSHSelfAttention (full-attn path, attn_chunks={heads}): padded batch vs each sequence alone, "
      f"max abs diff = {max(diffs):.6f}")
