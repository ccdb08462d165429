"""Plan TREAD routes for a model, data size and target (tread/cli/plan_routes.py; `--help` lists every flag).

    python scripts/plan_routes.py --arch DiT-B/2 --target-speedup 1.3                 # FLOPs only, seconds
    python scripts/plan_routes.py --arch DiT-B/2 --batch 64 --target-speedup 1.3 --measure 3   # + timing
    python scripts/plan_routes.py --arch DiT-T/4 --batch 8 --target-speedup 1.1 --pilot 200 --pilot-top 2
"""
from tread.cli.plan_routes import main

if __name__ == "__main__":
    main()
