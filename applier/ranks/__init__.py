"""Talking between ranks: the signed agreement on one plan (agree, signed, jobkey), rank 0's store host,
and the readable values every rank prints (readable/)."""
