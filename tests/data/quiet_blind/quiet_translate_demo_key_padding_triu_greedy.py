# Correct program (quiet batch quiet-r119b).
# Ported from thisiszhou/Transformer-Translate-Demo @ab2e457508d44a812237fa5cf5d038f8b1e981d8:
# model/multi_head_attention.py (MultiheadAttention: bool attn_mask masked_fill -inf, key_padding_mask
# [batch, src_len] True = pad), model/transformer_encoder.py, model/transformer_decoder.py,
# model/transformer.py (sequence-first encoder/decoder, generator over the flattened 8-slot target),
# utils/dataset.py (right-padded tgt_in contexts), utils/infer.py (get_padding_mask, get_upper_triangular,
# infer_with_transformer greedy loop). The port passes the source padding to the decoder's cross-attention
# as memory_key_padding_mask and indexes the sinusoid by sequence position; otherwise it is the project's.
# Checked against a per-sentence reference: the source unpadded (no source masks at all) and a double-loop
# attention that lets query i see key j only when j <= i and j is not a target pad.
import copy
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleList

cn_dict = {'<bos>': 0, '<eos>': 1, '<pad>': 2, '是': 3, '千': 4, '你': 5, '万': 6, '在': 7, '我': 8, '人': 9,
           '三': 10, '一': 11, '侠': 12, '遍': 13, '二': 14, '爱': 15, '好': 16, '钢铁': 17}
en_dict = {'<bos>': 0, '<eos>': 1, '<pad>': 2, 'i': 3, 'three': 4, 'am': 5, 'love': 6, 'you': 7, 'he': 8,
           'times': 9, 'is': 10, 'thousand': 11, 'hello': 12, 'iron': 13, 'man': 14}
sentence_pair_demo = [
    [('<bos>', 'i', 'am', 'iron', 'man', '<eos>'), ('<bos>', '我', '是', '钢铁', '侠', '<eos>')],
    [('<bos>', 'i', 'love', 'you', 'three', 'thousand', 'times', '<eos>'),
     ('<bos>', '我', '爱', '你', '三', '千', '遍', '<eos>')],
]


class Dictionary(object):
    def __init__(self, w2i: Dict[str, int]):
        self.w2i = w2i
        self.i2w = {v: k for k, v in w2i.items()}


class PositionalEncoding(Module):
    def __init__(self, word_emb_dim: int, dropout=0.1, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = Dropout(p=dropout)
        position_emb = torch.zeros(max_len, word_emb_dim)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        dim_div_term = torch.exp(torch.arange(0, word_emb_dim, 2).float() * (-math.log(10000.0) / word_emb_dim))
        position_emb[:, 0::2] = torch.sin(position * dim_div_term)
        position_emb[:, 1::2] = torch.cos(position * dim_div_term)
        self.register_buffer('pe', position_emb.unsqueeze(0))  # shape: (1, max_len, d_model)

    def forward(self, x: Tensor):
        # x: [batch_size, sequence_length, word_emb_dim]
        x = x + self.pe[:, :x.size(1)]
        return self.dropout(x)


class MultiheadAttention(Module):
    def __init__(self, word_emb_dim, nheads, dropout_prob=0.):
        super(MultiheadAttention, self).__init__()
        self.word_emb_dim = word_emb_dim
        self.num_heads = nheads
        self.dropout_prob = dropout_prob
        self.head_dim = word_emb_dim // nheads
        assert self.head_dim * nheads == self.word_emb_dim
        self.q_in_proj = Linear(word_emb_dim, word_emb_dim)
        self.k_in_proj = Linear(word_emb_dim, word_emb_dim)
        self.v_in_proj = Linear(word_emb_dim, word_emb_dim)
        self.out_proj = Linear(word_emb_dim, word_emb_dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None):
        # query: [tgt_len, batch, dim]; key/value: [src_len, batch, dim]
        # key_padding_mask: [batch, src_len]; attn_mask: [tgt_len, src_len]
        tgt_len, batch_size, word_emb_dim = query.size()
        num_heads = self.num_heads
        head_dim = word_emb_dim // num_heads
        scaling = float(head_dim) ** -0.5

        q = self.q_in_proj(query)
        k = self.k_in_proj(key)
        v = self.v_in_proj(value)
        q = q * scaling

        q = q.contiguous().view(tgt_len, batch_size * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, batch_size * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, batch_size * num_heads, head_dim).transpose(0, 1)
        src_len = k.size(1)

        attn_output_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_output_weights.size()) == [batch_size * num_heads, tgt_len, src_len]

        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_output_weights.masked_fill_(attn_mask, float('-inf'))
            else:
                attn_output_weights += attn_mask

        if key_padding_mask is not None:
            attn_output_weights = attn_output_weights.view(batch_size, num_heads, tgt_len, src_len)
            attn_output_weights = attn_output_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2),
                float('-inf'),
            )
            attn_output_weights = attn_output_weights.view(batch_size * num_heads, tgt_len, src_len)

        attn_output_weights = torch.softmax(attn_output_weights, dim=-1)
        attn_output_weights = torch.dropout(attn_output_weights, p=self.dropout_prob, train=self.training)

        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, batch_size, word_emb_dim)
        return self.out_proj(attn_output)


class TransformerEncoderLayer(Module):
    def __init__(self, word_emb_dim, nhead, dim_feedforward=2048, dropout_prob=0.1):
        super(TransformerEncoderLayer, self).__init__()
        self.self_attn = MultiheadAttention(word_emb_dim, nhead, dropout_prob=dropout_prob)
        self.linear1 = Linear(word_emb_dim, dim_feedforward)
        self.dropout = Dropout(dropout_prob)
        self.linear2 = Linear(dim_feedforward, word_emb_dim)
        self.norm1 = LayerNorm(word_emb_dim)
        self.norm2 = LayerNorm(word_emb_dim)
        self.dropout1 = Dropout(dropout_prob)
        self.dropout2 = Dropout(dropout_prob)
        self.activation = torch.relu

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        src2 = self.self_attn(src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)
        src = src + self.dropout1(src2)
        src = self.norm1(src)
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = src + self.dropout2(src2)
        src = self.norm2(src)
        return src


class TransformerEncoder(Module):
    def __init__(self, encoder_layer, num_layers, norm):
        super(TransformerEncoder, self).__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src: Tensor, mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
        return self.norm(output)


class TransformerDecoderLayer(Module):
    def __init__(self, word_emb_dim, nhead, dim_feedforward=2048, dropout_prob=0.1):
        super(TransformerDecoderLayer, self).__init__()
        self.self_attn = MultiheadAttention(word_emb_dim, nhead, dropout_prob=dropout_prob)
        self.multihead_attn = MultiheadAttention(word_emb_dim, nhead, dropout_prob=dropout_prob)
        self.linear1 = Linear(word_emb_dim, dim_feedforward)
        self.dropout = Dropout(dropout_prob)
        self.linear2 = Linear(dim_feedforward, word_emb_dim)
        self.norm1 = LayerNorm(word_emb_dim)
        self.norm2 = LayerNorm(word_emb_dim)
        self.norm3 = LayerNorm(word_emb_dim)
        self.dropout1 = Dropout(dropout_prob)
        self.dropout2 = Dropout(dropout_prob)
        self.dropout3 = Dropout(dropout_prob)
        self.activation = torch.relu

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        tgt2 = self.self_attn(tgt, tgt, tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)
        tgt = tgt + self.dropout1(tgt2)
        tgt = self.norm1(tgt)
        tgt2 = self.multihead_attn(tgt, memory, memory, attn_mask=memory_mask,
                                   key_padding_mask=memory_key_padding_mask)
        tgt = tgt + self.dropout2(tgt2)
        tgt = self.norm2(tgt)
        tgt2 = self.linear2(self.dropout(self.activation(self.linear1(tgt))))
        tgt = tgt + self.dropout3(tgt2)
        tgt = self.norm3(tgt)
        return tgt


class TransformerDecoder(Module):
    def __init__(self, decoder_layer, num_layers, norm):
        super(TransformerDecoder, self).__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        output = tgt
        for mod in self.layers:
            output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                         tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask)
        return self.norm(output)


def _get_clones(module, N):
    return ModuleList([copy.deepcopy(module) for _ in range(N)])


class Transformer(Module):
    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, tgt_sequence_size: int,
                 word_emb_dim: int = 32, nhead: int = 1, num_encoder_layers: int = 2,
                 num_decoder_layers: int = 2, dim_feedforward: int = 128, dropout_prob: float = 0.1) -> None:
        super(Transformer, self).__init__()
        self.word_emb_dim = word_emb_dim
        self.nhead = nhead
        self.tgt_sequence_size = tgt_sequence_size
        self.src_word_emb = Embedding(src_vocab_size, word_emb_dim)
        self.tgt_word_emb = Embedding(tgt_vocab_size, word_emb_dim)
        self.position_encoding = PositionalEncoding(word_emb_dim, dropout_prob)
        encoder_layer = TransformerEncoderLayer(word_emb_dim, nhead, dim_feedforward, dropout_prob)
        self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, LayerNorm(word_emb_dim))
        decoder_layer = TransformerDecoderLayer(word_emb_dim, nhead, dim_feedforward, dropout_prob)
        self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, LayerNorm(word_emb_dim))
        self.generator = Linear(word_emb_dim * tgt_sequence_size, tgt_vocab_size)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Optional[Tensor] = None,
                tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        # src: [batch, src_sequence_size]; tgt: [batch, tgt_sequence_size]; returns [batch, tgt_vocab_size]
        assert src.size(0) == tgt.size(0)
        src = self.position_encoding(self.src_word_emb(src))
        tgt = self.position_encoding(self.tgt_word_emb(tgt))
        src = src.transpose(0, 1)
        tgt = tgt.transpose(0, 1)
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask)
        decode_output: Tensor = self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                                             tgt_key_padding_mask=tgt_key_padding_mask,
                                             memory_key_padding_mask=memory_key_padding_mask)
        decode_output = decode_output.transpose(0, 1).contiguous().view(-1, self.word_emb_dim * self.tgt_sequence_size)
        output = self.generator(decode_output)
        return torch.softmax(output, dim=-1)


def pad_(seq: List, align_length: int, pad):
    seq.extend([pad for _ in range(align_length - len(seq))])


class Dataset(object):
    def __init__(self, src_dict, tgt_dict, corpus, src_sequence_size: int, tgt_sequence_size: int):
        self.src_dict = Dictionary(src_dict)
        self.tgt_dict = Dictionary(tgt_dict)
        self.corpus = corpus
        self.src_sequence_size = src_sequence_size
        self.tgt_sequence_size = tgt_sequence_size
        self.srcs = dict()
        self.datas = []
        self.offset = 0
        for i, sentence in enumerate(self.corpus):
            src, tgt = sentence
            src = [self.src_dict.w2i[x] for x in src]
            tgt = [self.tgt_dict.w2i[x] for x in tgt]
            self.srcs[i] = src
            for j, word in enumerate(tgt):
                context = tgt[: j]
                if len(context) == 0:
                    continue
                self.datas.append((i, context, word))
        self.data_length = len(self.datas)

    def get_batch(self, batch_size=2, padding_str='<pad>'):
        src_pad_i = self.src_dict.w2i[padding_str]
        tgt_pad_i = self.tgt_dict.w2i[padding_str]
        if self.offset >= self.data_length:
            self.offset = 0
        data = self.datas[self.offset: self.offset + batch_size]
        self.offset += batch_size
        src = [list(self.srcs[x[0]]) for x in data]
        tgt_in = [list(x[1]) for x in data]
        tgt_out = [x[2] for x in data]
        [pad_(x, self.src_sequence_size, src_pad_i) for x in src]
        [pad_(x, self.tgt_sequence_size, tgt_pad_i) for x in tgt_in]
        src = torch.tensor(src, dtype=torch.int64)
        tgt_in = torch.tensor(tgt_in, dtype=torch.int64)
        tgt_out = torch.tensor(tgt_out, dtype=torch.int64)
        return src, tgt_in, tgt_out, src == src_pad_i, tgt_in == tgt_pad_i


def transform_words_to_tensor(sequence: List[str], word_dict: Dictionary, sentence_length=8,
                              pad_str='<pad>') -> Tensor:
    sequence = [word_dict.w2i[x] for x in sequence]
    sequence.extend([word_dict.w2i[pad_str] for _ in range(sentence_length - len(sequence))])
    return torch.tensor(sequence, dtype=torch.int64).view(1, -1)


def get_padding_mask(input_tensor: Tensor, word_dict: Dictionary, pad_str='<pad>') -> Tensor:
    return input_tensor == word_dict.w2i[pad_str]


def get_upper_triangular(size):
    return torch.triu(torch.ones(size, size), diagonal=1) == 1


def infer_with_transformer(model, src, src_padding_mask, tgt_dict, max_length, tgt_mask):
    out_seq = ['<bos>']
    predict_word = ''
    steps = []
    while len(out_seq) < max_length and predict_word != '<eos>':
        tgt_in = transform_words_to_tensor(out_seq, tgt_dict)
        tgt_pad_mask = get_padding_mask(tgt_in, tgt_dict)
        output = model(src, tgt_in,
                       src_key_padding_mask=src_padding_mask,
                       tgt_key_padding_mask=tgt_pad_mask,
                       memory_key_padding_mask=src_padding_mask,
                       tgt_mask=tgt_mask)
        steps.append((tgt_in, output))
        word_i = torch.argmax(output, -1).item()
        predict_word = tgt_dict.i2w[word_i]
        out_seq.append(predict_word)
    return out_seq, steps


# ---------------- reference: one sentence, source unpadded, double-loop attention ----------------

def ref_attention(mha: MultiheadAttention, x_q: Tensor, x_kv: Tensor, allowed) -> Tensor:
    # x_q: [Lq, d], x_kv: [Lk, d]; allowed(i, j) -> bool
    H, hd = mha.num_heads, mha.head_dim
    q = mha.q_in_proj(x_q) * hd ** -0.5
    k = mha.k_in_proj(x_kv)
    v = mha.v_in_proj(x_kv)
    out = torch.zeros_like(q)
    for h in range(H):
        sl = slice(h * hd, (h + 1) * hd)
        for i in range(x_q.size(0)):
            js = [j for j in range(x_kv.size(0)) if allowed(i, j)]
            scores = torch.stack([q[i, sl] @ k[j, sl] for j in js])
            w = torch.softmax(scores, dim=0)
            out[i, sl] = sum(w[n] * v[j, sl] for n, j in enumerate(js))
    return mha.out_proj(out)


def ref_forward(model: Transformer, src_ids: List[int], tgt_ids: Tensor, tgt_pad: int) -> Tensor:
    pe = model.position_encoding.pe[0]
    x = model.src_word_emb(torch.tensor(src_ids)) + pe[:len(src_ids)]
    for layer in model.encoder.layers:
        x = layer.norm1(x + ref_attention(layer.self_attn, x, x, lambda i, j: True))
        x = layer.norm2(x + layer.linear2(torch.relu(layer.linear1(x))))
    memory = model.encoder.norm(x)
    y = model.tgt_word_emb(tgt_ids) + pe[:tgt_ids.size(0)]
    is_pad = (tgt_ids == tgt_pad).tolist()
    for layer in model.decoder.layers:
        y = layer.norm1(y + ref_attention(layer.self_attn, y, y, lambda i, j: j <= i and not is_pad[j]))
        y = layer.norm2(y + ref_attention(layer.multihead_attn, y, memory, lambda i, j: True))
        y = layer.norm3(y + layer.linear2(torch.relu(layer.linear1(y))))
    y = model.decoder.norm(y)
    return torch.softmax(model.generator(y.reshape(1, -1)), dim=-1)[0]


def main():
    torch.manual_seed(0)
    src_sequence_size = tgt_sequence_size = 8
    dataset = Dataset(en_dict, cn_dict, sentence_pair_demo, src_sequence_size, tgt_sequence_size)
    model = Transformer(src_vocab_size=len(en_dict), tgt_vocab_size=len(cn_dict), word_emb_dim=8,
                        nhead=2, tgt_sequence_size=8, num_encoder_layers=1, num_decoder_layers=1,
                        dropout_prob=0)
    loss_f = torch.nn.NLLLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    upper_tri = get_upper_triangular(8)
    model.train()
    for i in range(40):  # (200 in the project; 40 here to keep the test suite short: the checks below hold at any step)
        optimizer.zero_grad()
        src, tgt_in, tgt_out, src_pad_mask, tgt_pad_mask = dataset.get_batch(batch_size=4)
        output = model(src, tgt_in, tgt_mask=upper_tri, src_key_padding_mask=src_pad_mask,
                       tgt_key_padding_mask=tgt_pad_mask, memory_key_padding_mask=src_pad_mask)
        loss = loss_f(torch.log(output), tgt_out)
        loss.backward()
        optimizer.step()
    print("final training loss:", loss.item())

    model.eval()
    en, cn = Dictionary(en_dict), Dictionary(cn_dict)
    with torch.no_grad():
        # a batch of the training contexts against the per-sentence reference
        src, tgt_in, tgt_out, src_pad_mask, tgt_pad_mask = dataset.get_batch(batch_size=6)
        output = model(src, tgt_in, tgt_mask=upper_tri, src_key_padding_mask=src_pad_mask,
                       tgt_key_padding_mask=tgt_pad_mask, memory_key_padding_mask=src_pad_mask)
        for b in range(src.size(0)):
            src_ids = src[b][~src_pad_mask[b]].tolist()
            ref = ref_forward(model, src_ids, tgt_in[b], cn_dict['<pad>'])
            err = (output[b] - ref).abs().max().item()
            assert err < 1e-5, (b, err)

        for pair in sentence_pair_demo:
            src_sentence = list(pair[0])
            src_tensor = transform_words_to_tensor(src_sentence, en)
            out_seq, steps = infer_with_transformer(model, src_tensor, get_padding_mask(src_tensor, en), cn,
                                                    max_length=8, tgt_mask=upper_tri)
            src_ids = [en_dict[w] for w in src_sentence]
            for tgt_in, output in steps:
                ref = ref_forward(model, src_ids, tgt_in[0], cn_dict['<pad>'])
                assert (output[0] - ref).abs().max().item() < 1e-5
                assert output[0].argmax().item() == ref.argmax().item()
            print("Input sentence:", src_sentence, "\n", "After translate:", out_seq)
    print("ok: masked batch and greedy steps match the per-sentence double-loop reference")


if __name__ == "__main__":
    main()
