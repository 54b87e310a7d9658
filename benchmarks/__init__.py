"""Side-by-side benchmarks; each has ``main(argv)`` so ``pdserve bench NAME`` can run it."""
