"""Input pipelines: TF's queues, queue runners, producers and batching (resumable), and
resumable PyTorch data loading."""
