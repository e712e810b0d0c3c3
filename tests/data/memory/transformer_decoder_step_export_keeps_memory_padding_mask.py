# Correct (quiet): an nn.Transformer encoder-decoder over a left-padded source, its decoder exported through a
# positional "decoder step" wrapper that does take the source padding (memory_key_padding_mask, True = pad) and
# hands it to nn.TransformerDecoder, as optimum's fixed decoder export keeps encoder_attention_mask. No decoder query
# sees a padded source position, in the wrapper's run as in the eager one.
import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
CONFIG = {"vocab": 40, "d_model": 32, "nhead": 4, "layers": 2, "pad_id": 0, "bos_id": 1}


class Seq2Seq(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab"], c["d_model"], padding_idx=c["pad_id"])
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(c["d_model"], c["nhead"], 64, dropout=0.0, batch_first=True), c["layers"],
            enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(c["d_model"], c["nhead"], 64, dropout=0.0, batch_first=True), c["layers"])
        self.out = nn.Linear(c["d_model"], c["vocab"])

    def encode(self, src):
        return self.encoder(self.embed(src), src_key_padding_mask=src.eq(self.c["pad_id"]))

    def decode(self, tgt, memory, memory_key_padding_mask):
        T = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        y = self.decoder(self.embed(tgt), memory, tgt_mask=causal, memory_key_padding_mask=memory_key_padding_mask)
        return self.out(y)


class DecoderStepForExport(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tgt, memory, memory_key_padding_mask):
        return self.model.decode(tgt, memory, memory_key_padding_mask)[:, -1]


model = Seq2Seq(CONFIG).eval()
step = DecoderStepForExport(model).eval()
src = torch.tensor([[0, 0, 0, 7, 12, 5, 9, 3],
                    [4, 8, 15, 16, 23, 11, 6, 2],
                    [0, 0, 0, 0, 0, 21, 13, 2]])
pad = src.eq(CONFIG["pad_id"])
with torch.no_grad():
    memory = model.encode(src)
    tgt = torch.full((3, 1), CONFIG["bos_id"])
    for _ in range(4):
        logits = step(tgt, memory, pad)
        tgt = torch.cat([tgt, logits.argmax(-1, keepdim=True)], 1)
print("decoded:", tgt.tolist(), "argv:", sys.argv[1:])
