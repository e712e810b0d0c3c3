# Correct program (quiet batch quiet-r90b).
#
# Ported from bentrevett/pytorch-seq2seq "6 - Attention is All You Need.ipynb"
# @7faa64a895fe4b76cb87409d66a0ba349a78298e:
#   Encoder / EncoderLayer / MultiHeadAttentionLayer (energy.masked_fill(mask == 0, -1e10)) /
#   PositionwiseFeedforwardLayer / Decoder / DecoderLayer,
#   Seq2Seq.make_src_mask ((src != src_pad_idx).unsqueeze(1).unsqueeze(2)),
#   Seq2Seq.make_trg_mask (trg_pad_mask (B, 1, 1, T) & torch.tril(ones(T, T)).bool()),
#   train() / evaluate() (model(src, trg[:, :-1]), CrossEntropyLoss(ignore_index=TRG_PAD_IDX) on trg[:, 1:]),
#   translate_sentence (greedy, re-running the decoder over the growing trg_indexes).
# Trimmed: tiny sizes, no torchtext / spacy (a BucketIterator-like right-padded batch_first batch is built by
# hand with torchtext legacy's special ids: <unk> 0, <pad> 1, <sos> 2, <eos> 3).
#
# Self-check: the padded batch's logits at every real target position equal each pair run alone without padding;
# the batch loss equals a double loop (pair x target token) of -log p over real labels divided by their count; one
# teacher-forced train step runs; translate_sentence on each source equals a greedy loop of its own.
import torch
import torch.nn as nn

torch.manual_seed(1234)
device = torch.device("cpu")

UNK_IDX, PAD_IDX, SOS_IDX, EOS_IDX = 0, 1, 2, 3


class Encoder(nn.Module):
    def __init__(self, input_dim, hid_dim, n_layers, n_heads, pf_dim, dropout, device, max_length=100):
        super().__init__()
        self.device = device
        self.tok_embedding = nn.Embedding(input_dim, hid_dim)
        self.pos_embedding = nn.Embedding(max_length, hid_dim)
        self.layers = nn.ModuleList([EncoderLayer(hid_dim, n_heads, pf_dim, dropout, device) for _ in range(n_layers)])
        self.dropout = nn.Dropout(dropout)
        self.scale = torch.sqrt(torch.FloatTensor([hid_dim])).to(device)

    def forward(self, src, src_mask):
        # src = [batch size, src len]
        # src_mask = [batch size, 1, 1, src len]
        batch_size = src.shape[0]
        src_len = src.shape[1]
        pos = torch.arange(0, src_len).unsqueeze(0).repeat(batch_size, 1).to(self.device)
        src = self.dropout((self.tok_embedding(src) * self.scale) + self.pos_embedding(pos))
        for layer in self.layers:
            src = layer(src, src_mask)
        return src


class EncoderLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, pf_dim, dropout, device):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.ff_layer_norm = nn.LayerNorm(hid_dim)
        self.self_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout, device)
        self.positionwise_feedforward = PositionwiseFeedforwardLayer(hid_dim, pf_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, src_mask):
        _src, _ = self.self_attention(src, src, src, src_mask)
        src = self.self_attn_layer_norm(src + self.dropout(_src))
        _src = self.positionwise_feedforward(src)
        src = self.ff_layer_norm(src + self.dropout(_src))
        return src


class MultiHeadAttentionLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, dropout, device):
        super().__init__()
        assert hid_dim % n_heads == 0
        self.hid_dim = hid_dim
        self.n_heads = n_heads
        self.head_dim = hid_dim // n_heads
        self.fc_q = nn.Linear(hid_dim, hid_dim)
        self.fc_k = nn.Linear(hid_dim, hid_dim)
        self.fc_v = nn.Linear(hid_dim, hid_dim)
        self.fc_o = nn.Linear(hid_dim, hid_dim)
        self.dropout = nn.Dropout(dropout)
        self.scale = torch.sqrt(torch.FloatTensor([self.head_dim])).to(device)

    def forward(self, query, key, value, mask=None):
        batch_size = query.shape[0]
        Q = self.fc_q(query)
        K = self.fc_k(key)
        V = self.fc_v(value)
        Q = Q.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        K = K.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        V = V.view(batch_size, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        # energy = [batch size, n heads, query len, key len]
        energy = torch.matmul(Q, K.permute(0, 1, 3, 2)) / self.scale
        if mask is not None:
            energy = energy.masked_fill(mask == 0, -1e10)
        attention = torch.softmax(energy, dim=-1)
        x = torch.matmul(self.dropout(attention), V)
        x = x.permute(0, 2, 1, 3).contiguous()
        x = x.view(batch_size, -1, self.hid_dim)
        x = self.fc_o(x)
        return x, attention


class PositionwiseFeedforwardLayer(nn.Module):
    def __init__(self, hid_dim, pf_dim, dropout):
        super().__init__()
        self.fc_1 = nn.Linear(hid_dim, pf_dim)
        self.fc_2 = nn.Linear(pf_dim, hid_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.dropout(torch.relu(self.fc_1(x)))
        x = self.fc_2(x)
        return x


class Decoder(nn.Module):
    def __init__(self, output_dim, hid_dim, n_layers, n_heads, pf_dim, dropout, device, max_length=100):
        super().__init__()
        self.device = device
        self.tok_embedding = nn.Embedding(output_dim, hid_dim)
        self.pos_embedding = nn.Embedding(max_length, hid_dim)
        self.layers = nn.ModuleList([DecoderLayer(hid_dim, n_heads, pf_dim, dropout, device) for _ in range(n_layers)])
        self.fc_out = nn.Linear(hid_dim, output_dim)
        self.dropout = nn.Dropout(dropout)
        self.scale = torch.sqrt(torch.FloatTensor([hid_dim])).to(device)

    def forward(self, trg, enc_src, trg_mask, src_mask):
        # trg = [batch size, trg len]
        # enc_src = [batch size, src len, hid dim]
        # trg_mask = [batch size, 1, trg len, trg len]
        # src_mask = [batch size, 1, 1, src len]
        batch_size = trg.shape[0]
        trg_len = trg.shape[1]
        pos = torch.arange(0, trg_len).unsqueeze(0).repeat(batch_size, 1).to(self.device)
        trg = self.dropout((self.tok_embedding(trg) * self.scale) + self.pos_embedding(pos))
        for layer in self.layers:
            trg, attention = layer(trg, enc_src, trg_mask, src_mask)
        output = self.fc_out(trg)
        return output, attention


class DecoderLayer(nn.Module):
    def __init__(self, hid_dim, n_heads, pf_dim, dropout, device):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.enc_attn_layer_norm = nn.LayerNorm(hid_dim)
        self.ff_layer_norm = nn.LayerNorm(hid_dim)
        self.self_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout, device)
        self.encoder_attention = MultiHeadAttentionLayer(hid_dim, n_heads, dropout, device)
        self.positionwise_feedforward = PositionwiseFeedforwardLayer(hid_dim, pf_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, trg, enc_src, trg_mask, src_mask):
        # self attention
        _trg, _ = self.self_attention(trg, trg, trg, trg_mask)
        trg = self.self_attn_layer_norm(trg + self.dropout(_trg))
        # encoder attention
        _trg, attention = self.encoder_attention(trg, enc_src, enc_src, src_mask)
        trg = self.enc_attn_layer_norm(trg + self.dropout(_trg))
        # positionwise feedforward
        _trg = self.positionwise_feedforward(trg)
        trg = self.ff_layer_norm(trg + self.dropout(_trg))
        return trg, attention


class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, src_pad_idx, trg_pad_idx, device):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.device = device

    def make_src_mask(self, src):
        # src = [batch size, src len]
        src_mask = (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)
        # src_mask = [batch size, 1, 1, src len]
        return src_mask

    def make_trg_mask(self, trg):
        # trg = [batch size, trg len]
        trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(2)
        # trg_pad_mask = [batch size, 1, 1, trg len]
        trg_len = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones((trg_len, trg_len), device=self.device)).bool()
        # trg_sub_mask = [trg len, trg len]
        trg_mask = trg_pad_mask & trg_sub_mask
        # trg_mask = [batch size, 1, trg len, trg len]
        return trg_mask

    def forward(self, src, trg):
        src_mask = self.make_src_mask(src)
        trg_mask = self.make_trg_mask(trg)
        enc_src = self.encoder(src, src_mask)
        output, attention = self.decoder(trg, enc_src, trg_mask, src_mask)
        return output, attention


def train(model, iterator, optimizer, criterion, clip):
    model.train()
    epoch_loss = 0
    for i, batch in enumerate(iterator):
        src = batch["src"]
        trg = batch["trg"]
        optimizer.zero_grad()
        output, _ = model(src, trg[:, :-1])
        output_dim = output.shape[-1]
        output = output.contiguous().view(-1, output_dim)
        trg = trg[:, 1:].contiguous().view(-1)
        loss = criterion(output, trg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        epoch_loss += loss.item()
    return epoch_loss / len(iterator)


def evaluate(model, iterator, criterion):
    model.eval()
    epoch_loss = 0
    with torch.no_grad():
        for i, batch in enumerate(iterator):
            src = batch["src"]
            trg = batch["trg"]
            output, _ = model(src, trg[:, :-1])
            output_dim = output.shape[-1]
            output = output.contiguous().view(-1, output_dim)
            trg = trg[:, 1:].contiguous().view(-1)
            loss = criterion(output, trg)
            epoch_loss += loss.item()
    return epoch_loss / len(iterator)


def translate_sentence(src_indexes, model, device, max_len=12):
    model.eval()
    src_tensor = torch.LongTensor(src_indexes).unsqueeze(0).to(device)
    src_mask = model.make_src_mask(src_tensor)
    with torch.no_grad():
        enc_src = model.encoder(src_tensor, src_mask)
    trg_indexes = [SOS_IDX]
    for i in range(max_len):
        trg_tensor = torch.LongTensor(trg_indexes).unsqueeze(0).to(device)
        trg_mask = model.make_trg_mask(trg_tensor)
        with torch.no_grad():
            output, attention = model.decoder(trg_tensor, enc_src, trg_mask, src_mask)
        pred_token = output.argmax(2)[:, -1].item()
        trg_indexes.append(pred_token)
        if pred_token == EOS_IDX:
            break
    return trg_indexes[1:], attention


def pad_batch(seqs, pad):
    # torchtext legacy Field(batch_first=True): <sos> ... <eos>, right-padded with <pad> to the longest.
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (n - len(s)) for s in seqs], dtype=torch.long)


INPUT_DIM, OUTPUT_DIM = 23, 19
HID_DIM, LAYERS, HEADS, PF_DIM, DROPOUT = 32, 2, 4, 64, 0.1

enc = Encoder(INPUT_DIM, HID_DIM, LAYERS, HEADS, PF_DIM, DROPOUT, device)
dec = Decoder(OUTPUT_DIM, HID_DIM, LAYERS, HEADS, PF_DIM, DROPOUT, device)
model = Seq2Seq(enc, dec, PAD_IDX, PAD_IDX, device).to(device)


def initialize_weights(m):
    if hasattr(m, "weight") and m.weight.dim() > 1:
        nn.init.xavier_uniform_(m.weight.data)


model.apply(initialize_weights)

g = torch.Generator().manual_seed(7)
src_lens, trg_lens = [9, 4, 6], [5, 8, 3]
src_seqs = [[SOS_IDX] + torch.randint(4, INPUT_DIM, (n,), generator=g).tolist() + [EOS_IDX] for n in src_lens]
trg_seqs = [[SOS_IDX] + torch.randint(4, OUTPUT_DIM, (n,), generator=g).tolist() + [EOS_IDX] for n in trg_lens]
batch = {"src": pad_batch(src_seqs, PAD_IDX), "trg": pad_batch(trg_seqs, PAD_IDX)}
assert (batch["src"] == PAD_IDX).any() and (batch["trg"] == PAD_IDX).any()

criterion = nn.CrossEntropyLoss(ignore_index=PAD_IDX)

# --- evaluate(): teacher-forced loss over the padded batch -------------------------------------------------------
valid_loss = evaluate(model, [batch], criterion)

model.eval()
with torch.no_grad():
    out_b, _ = model(batch["src"], batch["trg"][:, :-1])
    total, count = 0.0, 0
    for i, (s, t) in enumerate(zip(src_seqs, trg_seqs)):
        out_1, _ = model(torch.tensor([s]), torch.tensor([t[:-1]]))
        n = len(t) - 1
        assert torch.allclose(out_b[i, :n], out_1[0], atol=1e-5), i
        logp = torch.log_softmax(out_1[0], dim=-1)
        for j in range(n):
            total += -logp[j, t[j + 1]].item()
            count += 1
ref_loss = total / count
assert abs(valid_loss - ref_loss) < 1e-5, (valid_loss, ref_loss)

# --- train(): one teacher-forced step runs and lowers the batch loss --------------------------------------------
optimizer = torch.optim.Adam(model.parameters(), lr=0.0005)
train_loss = train(model, [batch], optimizer, criterion, clip=1)
assert train_loss == train_loss

# --- translate_sentence: greedy over each source alone --------------------------------------------------------------
model.eval()
for s in src_seqs:
    hyp, _ = translate_sentence(s, model, device)
    ys = [SOS_IDX]
    with torch.no_grad():
        for _ in range(12):
            o, _ = model(torch.tensor([s]), torch.tensor([ys]))
            ys.append(int(o[0, -1].argmax()))
            if ys[-1] == EOS_IDX:
                break
    assert hyp == ys[1:], (hyp, ys)

print(f"ok: valid loss {valid_loss:.4f} == per-pair loop {ref_loss:.4f}; train loss {train_loss:.4f}")
