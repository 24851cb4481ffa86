"""What the assets and the pipelines both stand on: resources, shard partitions, source
listings, S3 staging and the staleness model. It imports neither ``assets`` stages nor
``pipelines``: ``pipelines`` → ``assets`` → ``assets.support`` → ``tokenmill``.
"""
