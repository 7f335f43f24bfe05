"""What tests share: processes, tiny models, fake drafts, statistics, scripted models and HTTP calls."""
