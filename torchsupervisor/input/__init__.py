"""Input pipelines: TF's queues and queue runners, and resumable PyTorch data loading."""
