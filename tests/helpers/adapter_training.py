"""A few AdamW steps on one memorised batch, for adapter (PEFT) tests, and the tolerance of merged weights against
the adapter."""

import torch

# fp32 logits of the merged model vs the adapter model: only summation order differs (largest measured over the
# method matrix: 5.1e-6, OSF on Llama; 2.1e-6 on DIFF).
MERGE_ATOL = 2e-5
STEPS, LR = 20, 1e-2


def train(model, batch: torch.Tensor, steps: int = STEPS, lr: float = LR) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
