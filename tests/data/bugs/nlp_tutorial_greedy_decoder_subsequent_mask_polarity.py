# graykode/nlp-tutorial (5-1.Transformer/Transformer-Torch.py), fixed in PR #17 (commits 005d34b, 5b4fb5e):
# the greedy decoder built dec_mask as (triu(...,1) == 0) although the attention fills True with -1e9, and
# training ran the decoder self-attention with no subsequent mask at all.
import sys
import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# S: start of decoding input, E: end of decoding output, P: padding
sentences = ['ich mochte ein bier P', 'S i want a beer', 'i want a beer E']
src_vocab = {'P': 0, 'ich': 1, 'mochte': 2, 'ein': 3, 'bier': 4}
src_vocab_size = len(src_vocab)
tgt_vocab = {'P': 0, 'i': 1, 'want': 2, 'a': 3, 'beer': 4, 'S': 5, 'E': 6}
number_dict = {i: w for w, i in tgt_vocab.items()}
tgt_vocab_size = len(tgt_vocab)
src_len = tgt_len = 5
d_model, d_ff, d_k, d_v, n_layers, n_heads = 16, 32, 4, 4, 2, 2


def make_batch(sentences):
    input_batch = [[src_vocab[n] for n in sentences[0].split()]]
    output_batch = [[tgt_vocab[n] for n in sentences[1].split()]]
    target_batch = [[tgt_vocab[n] for n in sentences[2].split()]]
    return torch.LongTensor(input_batch), torch.LongTensor(output_batch), torch.LongTensor(target_batch)


def get_sinusoid_encoding_table(n_position, d_model):
    pos = np.arange(n_position)[:, None] / np.power(10000, 2 * (np.arange(d_model)[None, :] // 2) / d_model)
    pos[:, 0::2] = np.sin(pos[:, 0::2])
    pos[:, 1::2] = np.cos(pos[:, 1::2])
    return torch.FloatTensor(pos)


def get_attn_pad_mask(seq_q, seq_k):
    batch_size, len_q = seq_q.size()
    batch_size, len_k = seq_k.size()
    pad_attn_mask = seq_k.data.eq(0).unsqueeze(1)  # batch_size x 1 x len_k, True = pad
    return pad_attn_mask.expand(batch_size, len_q, len_k)


def get_attn_subsequent_mask(seq):
    attn_shape = [seq.size(0), seq.size(1), seq.size(1)]
    subsequent_mask = np.triu(np.ones(attn_shape), k=1)
    return torch.from_numpy(subsequent_mask).byte()


class ScaledDotProductAttention(nn.Module):
    def forward(self, Q, K, V, attn_mask=None):
        scores = torch.matmul(Q, K.transpose(-1, -2)) / np.sqrt(d_k)
        if attn_mask is not None:
            scores.masked_fill_(attn_mask, -1e9)
        attn = nn.Softmax(dim=-1)(scores)
        return torch.matmul(attn, V), attn


class MultiHeadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.W_Q = nn.Linear(d_model, d_k * n_heads)
        self.W_K = nn.Linear(d_model, d_k * n_heads)
        self.W_V = nn.Linear(d_model, d_v * n_heads)
        self.linear = nn.Linear(n_heads * d_v, d_model)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, Q, K, V, attn_mask=None):
        residual, batch_size = Q, Q.size(0)
        q_s = self.W_Q(Q).view(batch_size, -1, n_heads, d_k).transpose(1, 2)
        k_s = self.W_K(K).view(batch_size, -1, n_heads, d_k).transpose(1, 2)
        v_s = self.W_V(V).view(batch_size, -1, n_heads, d_v).transpose(1, 2)
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(1).repeat(1, n_heads, 1, 1)
        context, attn = ScaledDotProductAttention()(q_s, k_s, v_s, attn_mask=attn_mask)
        context = context.transpose(1, 2).contiguous().view(batch_size, -1, n_heads * d_v)
        return self.layer_norm(self.linear(context) + residual), attn


class PoswiseFeedForwardNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(d_model, d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(d_ff, d_model, kernel_size=1)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inputs):
        output = self.conv2(torch.relu(self.conv1(inputs.transpose(1, 2)))).transpose(1, 2)
        return self.layer_norm(output + inputs)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_self_attn = MultiHeadAttention()
        self.pos_ffn = PoswiseFeedForwardNet()

    def forward(self, enc_inputs, enc_self_attn_mask):
        enc_outputs, attn = self.enc_self_attn(enc_inputs, enc_inputs, enc_inputs, enc_self_attn_mask)
        return self.pos_ffn(enc_outputs), attn


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.dec_self_attn = MultiHeadAttention()
        self.dec_enc_attn = MultiHeadAttention()
        self.pos_ffn = PoswiseFeedForwardNet()

    def forward(self, dec_inputs, enc_outputs, enc_attn_mask, dec_attn_mask=None):
        dec_outputs, dec_self_attn = self.dec_self_attn(dec_inputs, dec_inputs, dec_inputs, dec_attn_mask)
        dec_outputs, dec_enc_attn = self.dec_enc_attn(dec_outputs, enc_outputs, enc_outputs, enc_attn_mask)
        return self.pos_ffn(dec_outputs), dec_self_attn, dec_enc_attn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab_size, d_model)
        self.pos_emb = nn.Embedding.from_pretrained(get_sinusoid_encoding_table(src_len + 1, d_model), freeze=True)
        self.layers = nn.ModuleList([EncoderLayer() for _ in range(n_layers)])

    def forward(self, enc_inputs):
        enc_outputs = self.src_emb(enc_inputs) + self.pos_emb(torch.LongTensor([[1, 2, 3, 4, 5]]))
        enc_self_attn_mask = get_attn_pad_mask(enc_inputs, enc_inputs)
        for layer in self.layers:
            enc_outputs, _ = layer(enc_outputs, enc_self_attn_mask)
        return enc_outputs, None


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tgt_emb = nn.Embedding(tgt_vocab_size, d_model)
        self.pos_emb = nn.Embedding.from_pretrained(get_sinusoid_encoding_table(tgt_len + 1, d_model), freeze=True)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(n_layers)])

    def forward(self, dec_inputs, enc_inputs, enc_outputs, dec_attn_mask=None):
        dec_outputs = self.tgt_emb(dec_inputs) + self.pos_emb(torch.LongTensor([[1, 2, 3, 4, 5]]))
        if FIXED:
            dec_self_attn_pad_mask = get_attn_pad_mask(dec_inputs, dec_inputs)
            dec_self_attn_subsequent_mask = get_attn_subsequent_mask(dec_inputs)
            dec_attn_mask = torch.gt((dec_self_attn_pad_mask + dec_self_attn_subsequent_mask), 0)
        dec_enc_attn_pad_mask = get_attn_pad_mask(dec_inputs, enc_inputs)
        for layer in self.layers:
            dec_outputs, _, _ = layer(dec_outputs, enc_outputs, enc_attn_mask=dec_enc_attn_pad_mask,
                                      dec_attn_mask=dec_attn_mask)
        return dec_outputs, None, None


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.projection = nn.Linear(d_model, tgt_vocab_size, bias=False)

    def forward(self, enc_inputs, dec_inputs, decoder_mask=None):
        enc_outputs, _ = self.encoder(enc_inputs)
        dec_outputs, _, _ = self.decoder(dec_inputs, enc_inputs, enc_outputs, decoder_mask)
        dec_logits = self.projection(dec_outputs)
        return dec_logits.view(-1, dec_logits.size(-1))


def greedy_decoder(model, enc_input, start_symbol, fill=0):
    memory, _ = model.encoder(enc_input)
    dec_input = torch.ones(1, 5).fill_(fill).type_as(enc_input.data)
    dec_mask = None if FIXED else torch.from_numpy(np.triu(np.ones((1, 5, 5)), 1).astype('uint8')) == 0
    next_symbol = start_symbol
    step_logits = []
    for i in range(0, 5):
        dec_input[0][i] = next_symbol
        out = model.decoder(dec_input, enc_input, memory, dec_mask)
        projected = model.projection(out[0])
        prob = projected.view(-1, projected.size(-1))
        step_logits.append(prob[i].detach())
        next_symbol = prob.data.max(1, keepdim=True)[1][i][0]
    return dec_input, torch.stack(step_logits)


model = Transformer()
optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
criterion = nn.CrossEntropyLoss()
enc_inputs, dec_inputs, target_batch = make_batch(sentences)
for epoch in range(10):
    optimizer.zero_grad()
    outputs = model(enc_inputs, dec_inputs)
    loss = criterion(outputs, target_batch.contiguous().view(-1))
    loss.backward()
    optimizer.step()
print('final training loss', round(loss.item(), 4))

model.eval()
with torch.no_grad():
    greedy_dec_input, logits_a = greedy_decoder(model, enc_inputs, start_symbol=tgt_vocab['S'], fill=0)
    _, logits_b = greedy_decoder(model, enc_inputs, start_symbol=tgt_vocab['S'], fill=tgt_vocab['beer'])
print(sentences[0], '->', [number_dict[n.item()] for n in greedy_dec_input[0]])
# the not-yet-decoded slots must not change what the decoder predicts at each step
print('max change of step logits when only the empty future slots differ: %.4f' % (logits_a - logits_b).abs().max().item())
