"""A fusion layer (quiet): the text attends itself with its padding hidden, then every text token attends the image.

ALBEF-style (salesforce/ALBEF, models/xbert.py): each fusion layer runs the question's self-attention under its key
padding mask, then a cross-attention from the text tokens to the image's patch embeddings, which are all real (an
image has no padding), so the cross-attention's softmax is handed no mask. The image has 9 patches and the text 6
tokens: fewer than the patches, so the patches could be misread as the text's keys and a few of the attention's own.
Self-check: each question run alone, unpadded, gives the same outputs at its real tokens.
"""
import torch

torch.manual_seed(0)
D, H, PATCHES = 16, 2, 9


class BertSelfAttention(torch.nn.Module):
    """xbert's: its own nn.Softmax; a self-attention, or a cross-attention where handed `encoder_hidden_states`."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(D, D) for _ in range(3))
        self.softmax = torch.nn.Softmax(dim=-1)

    def heads(self, x):
        return x.view(x.shape[0], x.shape[1], H, D // H).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = self.heads(self.query(hidden_states)), self.heads(self.key(source)), self.heads(self.value(source))
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        if attention_mask is not None:
            scores = scores + attention_mask
        out = self.softmax(scores) @ v
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], D)


own, crossed = BertSelfAttention(), BertSelfAttention()


def fusion(text, text_mask, image):
    """text (B, T, D) with text_mask (B, T) 1 = real; image (B, P, D), every patch real."""
    x = text + own(text, attention_mask=(1.0 - text_mask[:, None, None, :].float()) * -10000.0)
    return x + crossed(x, encoder_hidden_states=image)


def main():
    lengths = [6, 3, 4]
    text = torch.randn(len(lengths), max(lengths), D)
    mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])
    image = torch.randn(len(lengths), PATCHES, D)
    out = fusion(fusion(text, mask, image), mask, image)
    for row, n in enumerate(lengths):
        alone = fusion(fusion(text[row:row + 1, :n], mask[row:row + 1, :n], image[row:row + 1]), mask[row:row + 1, :n],
                       image[row:row + 1])
        assert torch.allclose(out[row, :n], alone[0], atol=1e-5), row
    print("every question's real tokens match the question run alone")


with torch.no_grad():
    main()
