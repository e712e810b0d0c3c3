"""BiDAF attention flow with AllenNLP's non-memory-efficient masked_softmax (renormalised after the softmax).

Follows allenai/allennlp allennlp/nn/util.py (masked_softmax with memory_efficient=False, replace_masked_values,
weighted_sum) and allenai/allennlp-models allennlp_models/rc/models/bidaf.py (BidirectionalAttentionFlow.forward).
masked_softmax multiplies the SCORES by the 0/1 mask (masked scores become 0, not -inf), softmaxes, multiplies the
weights by the mask again and renormalises by their sum (+ a tiny epsilon), so masked keys get exactly zero weight.
Context-to-query attention: each passage word over the real question words (padding question words hidden).
Query-to-context: max over the question of the similarity, padded passage words replaced with -1e7, then a
masked_softmax over real passage words. Padded passage rows are computed and masked out of the span logits.
"""
import torch
import torch.nn as nn


def tiny_value_of_dtype(dtype):
    return 1e-13 if dtype in (torch.float, torch.double) else 1e-4


def masked_softmax(vector, mask, dim=-1, memory_efficient=False):
    if mask is None:
        return torch.nn.functional.softmax(vector, dim=dim)
    while mask.dim() < vector.dim():
        mask = mask.unsqueeze(1)
    if not memory_efficient:
        # the mask is applied twice on purpose: after the softmax, masked entries are zeroed and the rest rescaled
        result = torch.nn.functional.softmax(vector * mask, dim=dim)
        result = result * mask
        result = result / (result.sum(dim=dim, keepdim=True) + tiny_value_of_dtype(result.dtype))
    else:
        masked_vector = vector.masked_fill(~mask, torch.finfo(vector.dtype).min)
        result = torch.nn.functional.softmax(masked_vector, dim=dim)
    return result


def replace_masked_values(tensor, mask, replace_with):
    return tensor.masked_fill(~mask, replace_with)


def weighted_sum(matrix, attention):
    if attention.dim() == 2 and matrix.dim() == 3:
        return attention.unsqueeze(1).bmm(matrix).squeeze(1)
    return attention.bmm(matrix)


class LinearMatrixAttention(nn.Module):
    """similarity(p, q) = w . [p; q; p * q], the trilinear function BiDAF uses."""

    def __init__(self, dim):
        super().__init__()
        self.w = nn.Linear(3 * dim, 1)

    def forward(self, matrix_1, matrix_2):
        p = matrix_1.unsqueeze(2).expand(-1, -1, matrix_2.size(1), -1)
        q = matrix_2.unsqueeze(1).expand(-1, matrix_1.size(1), -1, -1)
        return self.w(torch.cat([p, q, p * q], dim=-1)).squeeze(-1)


def main():
    torch.manual_seed(0)
    dim = 16
    passage_lens, question_lens = [9, 6], [4, 2]
    encoded_passage = torch.randn(2, 9, dim)
    encoded_question = torch.randn(2, 4, dim)
    passage_mask = torch.arange(9)[None] < torch.tensor(passage_lens)[:, None]
    question_mask = torch.arange(4)[None] < torch.tensor(question_lens)[:, None]
    matrix_attention = LinearMatrixAttention(dim)
    span_start_predictor = nn.Linear(4 * dim, 1)
    with torch.no_grad():
        passage_question_similarity = matrix_attention(encoded_passage, encoded_question)  # [B, P, Q]
        passage_question_attention = masked_softmax(passage_question_similarity, question_mask)
        passage_question_vectors = weighted_sum(encoded_question, passage_question_attention)
        masked_similarity = replace_masked_values(passage_question_similarity, question_mask.unsqueeze(1), -1e7)
        question_passage_similarity = masked_similarity.max(dim=-1)[0]
        question_passage_attention = masked_softmax(question_passage_similarity, passage_mask)
        question_passage_vector = weighted_sum(encoded_passage, question_passage_attention)
        tiled = question_passage_vector.unsqueeze(1).expand(-1, 9, -1)
        final_merged_passage = torch.cat([encoded_passage, passage_question_vectors,
                                          encoded_passage * passage_question_vectors, encoded_passage * tiled], -1)
        span_start_logits = span_start_predictor(final_merged_passage).squeeze(-1)
        span_start_logits = replace_masked_values(span_start_logits, passage_mask, -1e7)
        # reference: each example cropped to its real lengths, plain softmax, no mask
        for b, (P, Q) in enumerate(zip(passage_lens, question_lens)):
            sim = matrix_attention(encoded_passage[b : b + 1, :P], encoded_question[b : b + 1, :Q])
            c2q = sim.softmax(-1).bmm(encoded_question[b : b + 1, :Q])
            q2c = sim.max(-1)[0].softmax(-1).unsqueeze(1).bmm(encoded_passage[b : b + 1, :P])
            assert torch.allclose(passage_question_vectors[b, :P], c2q[0], atol=1e-5)
            assert torch.allclose(question_passage_vector[b], q2c[0, 0], atol=1e-5)
    best = span_start_logits.argmax(-1)
    assert (best < torch.tensor(passage_lens)).all()
    print(f"span starts {best.tolist()}")


if __name__ == "__main__":
    main()
