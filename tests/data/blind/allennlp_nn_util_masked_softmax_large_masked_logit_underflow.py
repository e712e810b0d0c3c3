# allennlp, allenai/allennlp#437 ("Fix masked softmax"): util.masked_softmax ran softmax over the raw vector and
# only multiplied by the mask afterwards, so one large logit at a masked (padded) position drives the real weights to 0.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def masked_softmax(vector, mask):
    """allennlp/nn/util.py (2017): ``vector`` and ``mask`` are (batch_size, vector_dim); mask is 1 keep / 0 pad."""
    if mask is None:
        result = torch.nn.functional.softmax(vector, dim=-1)
    else:
        if FIXED:
            # To limit numerical errors from large vector elements outside mask, we zero these out
            result = torch.nn.functional.softmax(vector * mask, dim=-1)
        else:
            result = torch.nn.functional.softmax(vector, dim=-1)
        result = result * mask
        result = result / (result.sum(dim=1, keepdim=True) + 1e-13)
    return result


class DotProductSimilarity(torch.nn.Module):
    def forward(self, tensor_1, tensor_2):
        return (tensor_1 * tensor_2).sum(dim=-1)


class Attention(torch.nn.Module):
    """allennlp.modules.Attention: vector (batch, dim), matrix (batch, num_rows, dim), matrix_mask (batch, num_rows)."""

    def __init__(self, normalize=True):
        super().__init__()
        self._similarity_function = DotProductSimilarity()
        self._normalize = normalize

    def forward(self, vector, matrix, matrix_mask=None):
        tiled_vector = vector.unsqueeze(1).expand(vector.size()[0], matrix.size()[1], vector.size()[1])
        similarities = self._similarity_function(tiled_vector, matrix)
        if self._normalize:
            return masked_softmax(similarities, matrix_mask)
        return similarities


def weighted_sum(matrix, attention):
    return attention.unsqueeze(1).bmm(matrix).squeeze(1)


# A padded batch of encoder outputs: row 1 has 5 real positions and 3 padded positions whose (unmasked-encoder)
# outputs are large, as happens when the encoder does not zero its padded outputs.
batch, seq, dim = 2, 8, 16
lengths = torch.tensor([8, 5])
matrix_mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
encoder_outputs = torch.randn(batch, seq, dim)
query = torch.randn(batch, dim)
encoder_outputs[1, 5:] = 12.0 * query[1] / query[1].norm()  # padded rows aligned with the query: logit ~ 12*|q|

attention = Attention()
probs = attention(query, encoder_outputs, matrix_mask)
context = weighted_sum(encoder_outputs, probs)

# reference: row 1 alone, unpadded
ref_probs = attention(query[1:2], encoder_outputs[1:2, :5], matrix_mask[1:2, :5])
ref_context = weighted_sum(encoder_outputs[1:2, :5], ref_probs)

print("row-1 attention mass on real tokens:", round(probs[1, :5].sum().item(), 6))
print("max |padded-batch context - unpadded context| for row 1:", (context[1] - ref_context[0]).abs().max().item())
