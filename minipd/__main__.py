# Guarded: multiprocessing's spawn re-imports this module in every child as __mp_main__.
if __name__ == "__main__":
    from minipd.cli import main

    raise SystemExit(main())
