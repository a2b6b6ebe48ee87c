/* Link probe (cmake/DoptLayers.cmake): linked with every object of some
 * layers and nothing else; it links only if those layers need no layer above
 * them. It is never run. */
int main(void) { return 0; }
