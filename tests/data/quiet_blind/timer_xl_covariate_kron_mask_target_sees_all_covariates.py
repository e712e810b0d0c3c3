# Follows apache/iotdb ainode util/masking.py (from thuml Timer-XL): TimerMultivariateMask = kron(ones(V,V), triu(1)) and
# TimerCovariateMask = ~kron(eye(V), tril) with the target variate's rows opened to every covariate token (known covariates).
# Both are True = masked and go to Timer-XL's TimeAttention via scores.masked_fill_(mask, -inf). Checked against a per-query loop.
import math
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
B, V, N, D, H = 2, 3, 5, 32, 4  # batch, variates (last = target), patch tokens per variate, width, heads
E = D // H


class TriangularCausalMask:
    def __init__(self, B, L):
        self._mask = torch.triu(torch.ones([B, 1, L, L], dtype=torch.bool), diagonal=1)

    @property
    def mask(self):
        return self._mask


class TimerMultivariateMask:
    def __init__(self, B, n_vars, n_tokens):
        m1 = torch.ones((n_vars, n_vars), dtype=torch.bool)
        m2 = torch.triu(torch.ones([B, 1, n_tokens, n_tokens], dtype=torch.bool), diagonal=1)
        self._mask = torch.kron(m1, m2)

    @property
    def mask(self):
        return self._mask


class TimerCovariateMask:
    def __init__(self, B, n_vars, n_tokens):
        m1 = torch.eye(n_vars, dtype=torch.bool)
        m2 = torch.tril(torch.ones([B, 1, n_tokens, n_tokens], dtype=torch.bool))
        self._mask = ~torch.kron(m1, m2)
        self._mask[:, :, -n_tokens:, :-n_tokens] = False

    @property
    def mask(self):
        return self._mask


class TimeAttention(torch.nn.Module):
    """Tokens are variate-major: token index = v * N + n (as Timer-XL flattens [B, C, N, D] -> [B, C*N, D])."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)
        self.v = torch.nn.Linear(D, D)
        self.o = torch.nn.Linear(D, D)

    def heads(self, x):
        return x.view(x.shape[0], -1, H, E).transpose(1, 2)

    def forward(self, x, attn_mask):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        scores = torch.einsum("bhle,bhse->bhls", q, k)
        scores.masked_fill_(attn_mask, -math.inf)
        A = torch.softmax(scores / math.sqrt(E), dim=-1)
        out = torch.einsum("bhls,bhse->bhle", A, v)
        return self.o(out.transpose(1, 2).reshape(x.shape[0], -1, D))

    def loop(self, x, allowed):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        out = torch.zeros_like(q)
        L = x.shape[1]
        for i in range(L):
            js = [j for j in range(L) if allowed(i, j)]
            s = q[:, :, i : i + 1] @ k[:, :, js].transpose(-1, -2) / math.sqrt(E)
            out[:, :, i] = (torch.softmax(s, -1) @ v[:, :, js])[:, :, 0]
        return self.o(out.transpose(1, 2).reshape(x.shape[0], -1, D))


layers = torch.nn.ModuleList([TimeAttention() for _ in range(2)])
x = torch.randn(B, V * N, D)


def run(x, mask):
    for layer in layers:
        x = x + layer(x, mask)
    return x


def run_loop(x, allowed):
    for layer in layers:
        x = x + layer.loop(x, allowed)
    return x


var = lambda i: i // N
tim = lambda i: i % N
rules = {
    "multivariate": (TimerMultivariateMask(B, V, N).mask, lambda i, j: tim(j) <= tim(i)),
    "covariate": (
        TimerCovariateMask(B, V, N).mask,
        lambda i, j: (var(i) == var(j) and tim(j) <= tim(i)) or (var(i) == V - 1 and var(j) < V - 1),
    ),
    "univariate_causal": (TriangularCausalMask(B, N).mask, lambda i, j: j <= i),
}
worst = 0.0
with torch.no_grad():
    for name, (mask, allowed) in rules.items():
        xx = x if name != "univariate_causal" else x[:, :N]
        got = run(xx, mask)
        ref = run_loop(xx, allowed)
        d = (got - ref).abs().max().item()
        print(f"{name}: mask {tuple(mask.shape)} max|masked - per-query loop| = {d:.3e}")
        worst = max(worst, d)
    # covariate mode: perturbing a future *target* patch leaves earlier target outputs alone,
    # while the target still reads every covariate patch (future covariates are known inputs).
    mask = TimerCovariateMask(B, V, N).mask
    x2 = x.clone()
    x2[:, (V - 1) * N + N - 1] += 1.0
    d_future = (run(x, mask)[:, (V - 1) * N : (V - 1) * N + N - 1] - run(x2, mask)[:, (V - 1) * N : (V - 1) * N + N - 1]).abs().max().item()
    print(f"covariate: earlier target tokens after perturbing last target patch, max diff = {d_future:.3e}")
    worst = max(worst, d_future)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
