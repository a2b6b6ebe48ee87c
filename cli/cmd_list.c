/* distopt list: the registry with every optimizer's keys and defaults. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int cmd_list(int argc, char **argv) {
  (void)argc;
  (void)argv;
  char buf[32768]; /* the longest describe (galore: its keys, the inner's choices) fits many times */
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    dopt_status s = dopt_optim_describe(dopt_optim_registry_name(i), buf, sizeof buf);
    if (s != DOPT_OK) return cli_error("list", s);
    fputs(buf, stdout);
  }
  return CLI_OK;
}
