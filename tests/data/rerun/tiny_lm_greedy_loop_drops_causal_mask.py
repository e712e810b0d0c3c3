"""A tiny language model (a class whose name says nothing of decoding) built on nn.TransformerEncoder, trained one
step with a causal mask and then decoded greedily by running the whole prefix again at each step (no cache), as
tutorials write it (written here after TextBox's TransformerEncDec.generate, RUCAIBox/TextBox c9fe8cb; another model,
torch's own layers, two prompts a batch).

Buggy: the decode loop calls the model without the mask, so every earlier token of the prefix attends to the later
ones, unlike training. Fixed (--fixed): the loop hands nn.Transformer.generate_square_subsequent_mask(len) each step.
"""

import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
FIXED = "--fixed" in sys.argv
VOCAB, DIM = 40, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(64, DIM)
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, mask=None):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.head(self.blocks(x, mask=mask))


def main():
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(1, VOCAB, (3, 9))
    torch.nn.init.normal_(model.blocks.layers[0].self_attn.in_proj_weight, std=1.0)
    causal = nn.Transformer.generate_square_subsequent_mask(8)
    logits = model(batch[:, :-1], mask=causal)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    model.eval()
    tokens = batch[:2, :2]
    with torch.no_grad():
        for _ in range(5):
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1]) if FIXED else None
            step = model(tokens, mask=mask)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step], dim=1)
    print("loss", round(loss.item(), 4), "generated", tokens[:, 2:].tolist())


if __name__ == "__main__":
    main()
