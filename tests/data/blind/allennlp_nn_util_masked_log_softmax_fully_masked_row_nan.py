# allennlp, allenai/allennlp#893 (fixes #890): util.masked_log_softmax added mask.log() to the logits, so a row whose
# mask is all zeros becomes all -inf and log_softmax returns NaN, which then poisons the (row-masked) batch loss.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def masked_log_softmax(vector, mask):
    """allennlp/nn/util.py (early 2018): mask is a float 1 keep / 0 pad tensor of the same shape as vector."""
    if mask is not None:
        if FIXED:
            # vector + mask.log() is an easy way to zero out masked elements in logspace, but it
            # results in nans when the whole vector is masked.  We need a very small value instead of a
            # zero in the mask for these cases.
            vector = vector + (mask + 1e-45).log()
        else:
            vector = vector + mask.log()
    return torch.nn.functional.log_softmax(vector, dim=1)


class SpanStartPredictor(torch.nn.Module):
    """BiDAF-style span-start head: a linear scorer over passage encodings, masked by the passage mask."""

    def __init__(self, dim):
        super().__init__()
        self._span_start_predictor = torch.nn.Linear(dim, 1)

    def forward(self, encoded_passage, passage_mask, span_start):
        span_start_logits = self._span_start_predictor(encoded_passage).squeeze(-1)
        span_start_log_probs = masked_log_softmax(span_start_logits, passage_mask)
        # instances with an empty passage (a padded instance in the batch) carry no loss
        instance_mask = (passage_mask.sum(dim=1) > 0).float()
        nll = -span_start_log_probs.gather(1, span_start.unsqueeze(1)).squeeze(1)
        loss = (nll * instance_mask).sum() / instance_mask.sum()
        return loss, span_start_log_probs


batch, seq, dim = 3, 10, 16
lengths = torch.tensor([10, 6, 0])  # the third instance has an empty (fully padded) passage
passage_mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
encoded_passage = torch.randn(batch, seq, dim)
span_start = torch.tensor([3, 2, 0])

model = SpanStartPredictor(dim)
loss, log_probs = model(encoded_passage, passage_mask, span_start)
loss.backward()
grad = model._span_start_predictor.weight.grad

ref_loss, _ = model(encoded_passage[:2], passage_mask[:2], span_start[:2])
print("NaN entries in log-probs:", int(torch.isnan(log_probs).sum()))
print("batch loss:", loss.item(), " loss without the empty instance:", ref_loss.item())
print("|batch loss - loss without empty instance|:", (loss - ref_loss).abs().item(),
      " grad finite:", bool(torch.isfinite(grad).all()))
