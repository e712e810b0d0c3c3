# RVC-Boss/GPT-SoVITS PR #2153 (commit 053a356), Text2SemanticDecoder.infer_panel_batch_infer.
# The left-padding mask was built as padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2), which masks only
# (pad query, pad key) pairs, so real text/audio tokens attend to the padded text slots; the fix masks pad keys for every query.
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, NH, LAYERS, PHONES, VOCAB, BERT = 32, 4, 2, 30, 20, 16
EOS = VOCAB - 1


def make_pad_mask_left(lengths, max_len=0):
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).repeat(n, 1)
    expaned_lengths -= (max_len - lengths).unsqueeze(-1)
    return expaned_lengths < 0


class SinePositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, scale=False, alpha=False):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.x_scale = math.sqrt(embedding_dim) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)
        pe = torch.zeros(200, embedding_dim)
        position = torch.arange(0, 200, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, embedding_dim, 2, dtype=torch.float32) * -(math.log(10000.0) / embedding_dim))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        return x * self.x_scale + self.alpha * self.pe[:, : x.size(1)]


class T2SMLP:
    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class T2SBlock:
    def __init__(self, num_heads, hidden_dim):
        self.num_heads, self.hidden_dim = num_heads, hidden_dim
        r = lambda *s: torch.randn(*s) * 0.2
        self.mlp = T2SMLP(r(2 * hidden_dim, hidden_dim), r(2 * hidden_dim), r(hidden_dim, 2 * hidden_dim), r(hidden_dim))
        self.qkv_w, self.qkv_b = r(3 * hidden_dim, hidden_dim), r(3 * hidden_dim)
        self.out_w, self.out_b = r(hidden_dim, hidden_dim), r(hidden_dim)
        self.norm_w1, self.norm_b1, self.norm_eps1 = torch.ones(hidden_dim), torch.zeros(hidden_dim), 1e-5
        self.norm_w2, self.norm_b2, self.norm_eps2 = torch.ones(hidden_dim), torch.zeros(hidden_dim), 1e-5

    def to_mask(self, x, padding_mask):
        if padding_mask is None:
            return x
        return x.masked_fill(padding_mask, 0) if padding_mask.dtype == torch.bool else x * padding_mask

    def _post(self, x, attn):
        x = F.layer_norm(x + attn, [self.hidden_dim], self.norm_w1, self.norm_b1, self.norm_eps1)
        x = x + self.mlp.forward(x)
        return F.layer_norm(x, [self.hidden_dim], self.norm_w2, self.norm_b2, self.norm_eps2)

    def process_prompt(self, x, attn_mask, padding_mask=None, torch_sdpa=True):
        q, k, v = F.linear(self.to_mask(x, padding_mask), self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        batch_size, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        q = self.to_mask(q, padding_mask)
        k_cache = self.to_mask(k, padding_mask)
        v_cache = self.to_mask(v, padding_mask)
        q = q.view(batch_size, q_len, self.num_heads, -1).transpose(1, 2)
        k = k_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v = v_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, ~attn_mask)
        attn = attn.transpose(1, 2).reshape(batch_size, q_len, -1)
        attn = F.linear(self.to_mask(attn, padding_mask), self.out_w, self.out_b)
        return self._post(x, attn), k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask=None, torch_sdpa=True):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        k_cache = torch.cat([k_cache, k], dim=1)
        v_cache = torch.cat([v_cache, v], dim=1)
        batch_size, q_len, kv_len = q.shape[0], q.shape[1], k_cache.shape[1]
        q = q.view(batch_size, q_len, self.num_heads, -1).transpose(1, 2)
        k = k_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v = v_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, (~attn_mask) if attn_mask is not None else None)
        attn = F.linear(attn.transpose(1, 2).reshape(batch_size, q_len, -1), self.out_w, self.out_b)
        return self._post(x, attn), k_cache, v_cache


class T2STransformer:
    def __init__(self, num_blocks, blocks):
        self.num_blocks, self.blocks = num_blocks, blocks

    def process_prompt(self, x, attn_mask, padding_mask=None, torch_sdpa=True):
        k_cache, v_cache = [], []
        for i in range(self.num_blocks):
            x, k_, v_ = self.blocks[i].process_prompt(x, attn_mask, padding_mask, torch_sdpa)
            k_cache.append(k_)
            v_cache.append(v_)
        return x, k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask=None, torch_sdpa=True):
        for i in range(self.num_blocks):
            x, k_cache[i], v_cache[i] = self.blocks[i].decode_next_token(x, k_cache[i], v_cache[i], attn_mask, torch_sdpa)
        return x, k_cache, v_cache


class Text2SemanticDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_head = NH
        self.EOS = EOS
        self.bert_proj = nn.Linear(BERT, D)
        self.ar_text_embedding = nn.Embedding(PHONES, D)
        self.ar_text_position = SinePositionalEmbedding(D, scale=False, alpha=True)
        self.ar_audio_embedding = nn.Embedding(VOCAB, D)
        self.ar_audio_position = SinePositionalEmbedding(D, scale=False, alpha=True)
        self.ar_predict_layer = nn.Linear(D, VOCAB, bias=False)
        self.t2s_transformer = T2STransformer(LAYERS, [T2SBlock(NH, D) for _ in range(LAYERS)])

    @torch.no_grad()
    def infer_panel_batch_infer(self, x, x_lens, prompts, bert_feature, steps=6, **kwargs):
        max_len = kwargs.get("max_len", x_lens.max())
        x_list = []
        for x_item, bert_item in zip(x, bert_feature):
            x_item = self.ar_text_embedding(x_item.unsqueeze(0))
            x_item = x_item + self.bert_proj(bert_item.transpose(0, 1).unsqueeze(0))
            x_item = self.ar_text_position(x_item).squeeze(0)
            x_item = F.pad(x_item, (0, 0, max_len - x_item.shape[0], 0), value=0) if x_item.shape[0] < max_len else x_item  ### padding left
            x_list.append(x_item)
        x = torch.stack(x_list, dim=0)

        y = prompts
        x_len = x.shape[1]
        y_emb = self.ar_audio_embedding(y)
        y_len = y_emb.shape[1]
        y_lens = torch.LongTensor([y_emb.shape[1]] * y_emb.shape[0])
        y_pos = self.ar_audio_position(y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)

        ##### create mask #####
        bsz = x.shape[0]
        src_len = x_len + y_len
        y_paddind_mask = make_pad_mask_left(y_lens, y_len)
        x_paddind_mask = make_pad_mask_left(x_lens, max_len)
        padding_mask = torch.concat([x_paddind_mask, y_paddind_mask], dim=1)
        x_mask = F.pad(torch.zeros(x_len, x_len, dtype=torch.bool), (0, y_len), value=True)
        y_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)
        causal_mask = torch.concat([x_mask, y_mask], dim=0).view(1, src_len, src_len).repeat(bsz, 1, 1)
        if FIXED:
            padding_mask = padding_mask.view(bsz, 1, src_len).repeat(1, src_len, 1)
        else:
            padding_mask = padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2)  ### [b, x+y, x+y]
        attn_mask = causal_mask.logical_or(padding_mask)
        attn_mask = attn_mask.unsqueeze(1).expand(-1, self.num_head, -1, -1).bool()

        ###### decode (greedy instead of top-k sampling, fixed number of steps) #####
        all_logits = []
        for idx in range(steps):
            if idx == 0:
                xy_dec, k_cache, v_cache = self.t2s_transformer.process_prompt(xy_pos, attn_mask, None)
            else:
                xy_dec, k_cache, v_cache = self.t2s_transformer.decode_next_token(xy_pos, k_cache, v_cache, attn_mask)
            logits = self.ar_predict_layer(xy_dec[:, -1])
            if idx == 0:
                attn_mask = F.pad(attn_mask[:, :, -1].unsqueeze(-2), (0, 1), value=False)
                logits = logits[:, :-1]
            else:
                attn_mask = F.pad(attn_mask, (0, 1), value=False)
                logits = logits[:, :-1]  # keep the same width every step for the comparison
            all_logits.append(logits)
            samples = logits.argmax(-1, keepdim=True)
            y = torch.concat([y, samples], dim=1)
            y_emb = self.ar_audio_embedding(y[:, -1:])
            xy_pos = y_emb * self.ar_audio_position.x_scale + self.ar_audio_position.alpha * self.ar_audio_position.pe[:, y_len + idx]
        return torch.stack(all_logits, 1)


model = Text2SemanticDecoder().eval()
lens = [4, 10, 7]
phones = [torch.randint(0, PHONES, (n,)) for n in lens]
berts = [torch.randn(BERT, n) for n in lens]
prompts = torch.randint(0, VOCAB - 1, (3, 5))

batched = model.infer_panel_batch_infer(phones, torch.LongTensor(lens), prompts, berts)
diff = 0.0
for i in range(3):
    alone = model.infer_panel_batch_infer([phones[i]], torch.LongTensor([lens[i]]), prompts[i : i + 1], [berts[i]])
    diff = max(diff, (batched[i] - alone[0]).abs().max().item())
print(f"max |logits(left-padded batch) - logits(each text alone)| over decode loop: {diff:.6f}")
